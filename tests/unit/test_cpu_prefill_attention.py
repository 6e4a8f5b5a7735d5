"""The AVX512-BF16 prefill-attention kernel (engine/layers/cpu_prefill_attention.cpp) against the einsum oracle, and
through engine/layers/attention.py: prefill_attention against the torch path it replaces."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.kernels import reference
from engine.layers import attention, cpu_kernels
from tests.kernels.paged import TOLERANCE, int32, make_block_tables, make_cache, relative_error

pytestmark = [
    pytest.mark.skipif(shutil.which("c++") is None or shutil.which("ninja") is None,
                       reason="no C++ compiler or ninja to build the CPU kernels with"),
    pytest.mark.skipif(not torch.cpu._is_avx512_bf16_supported(), reason="no AVX512-BF16 on this CPU"),
]


def _oracle(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
            scale: float, sliding_window: int | None) -> torch.Tensor:
    return reference.paged_prefill_attention(q, k_cache, v_cache, block_table[None], int32([0, q.shape[0]]),
                                             int32([seq_len]), scale, sliding_window)


# query counts / context lengths: one token, lengths that are no multiple of the kernel's 16-key tiles, 6-row blocks
# or 256-key spans (300 takes two spans), and chunks of a longer context (a prefix cached, or a chunked prefill)
@pytest.mark.parametrize(("num_queries", "seq_len"), [(1, 1), (37, 37), (300, 300), (37, 100), (5, 300), (1, 300)])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (4, 4)])
@pytest.mark.parametrize("sliding_window", [None, 7, 50])
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (64, 4), (128, 16), (32, 4)])
def test_the_prefill_kernel_matches_the_oracle(num_queries: int, seq_len: int, num_heads: int, num_kv_heads: int,
                                               sliding_window: int | None, head_dim: int, block_size: int) -> None:
    module = cpu_kernels.kernel()
    assert module is not None and cpu_kernels.has_bf16_dot()  # a compiler and the CPU here: it must run
    torch.manual_seed(seq_len * 31 + num_queries)
    num_blocks = -(-seq_len // block_size) + 8
    cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, torch.bfloat16)  # K and V strided views
    block_table = make_block_tables([seq_len], block_size, num_blocks)[0]
    q = torch.randn(num_queries, num_heads, head_dim).to(torch.bfloat16)
    scale = head_dim ** -0.5

    out = module.paged_prefill_attention(q, cache.k, cache.v, block_table, seq_len, scale, sliding_window or 0)

    expected = _oracle(q, cache.k, cache.v, block_table, seq_len, scale, sliding_window)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert relative_error(out.float(), expected.float()) < TOLERANCE[torch.bfloat16]


def test_the_prefill_kernel_reads_strided_queries_and_a_head_size_of_256() -> None:
    module = cpu_kernels.kernel()
    assert module is not None
    torch.manual_seed(0)
    seq_len, num_queries, head_dim, block_size = 70, 20, 256, 16
    cache = make_cache(16, block_size, 2, head_dim, torch.bfloat16)
    block_table = make_block_tables([seq_len], block_size, 16)[0]
    # the queries as the model has them: a view into the fused q/k/v projection's rows
    qkv = torch.randn(num_queries, (4 + 2 * 2) * head_dim).to(torch.bfloat16)
    q = qkv[:, :4 * head_dim].view(num_queries, 4, head_dim)

    out = module.paged_prefill_attention(q, cache.k, cache.v, block_table, seq_len, head_dim ** -0.5, 0)

    expected = _oracle(q, cache.k, cache.v, block_table, seq_len, head_dim ** -0.5, None)
    assert relative_error(out.float(), expected.float()) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize(("num_queries", "seq_len", "sliding_window"), [(256, 256, None), (40, 90, 16)])
def test_prefill_attention_takes_the_kernel_and_agrees_with_the_torch_path(
        monkeypatch: pytest.MonkeyPatch, num_queries: int, seq_len: int, sliding_window: int | None) -> None:
    torch.manual_seed(seq_len)
    block_size, num_blocks = 16, 32
    cache = make_cache(num_blocks, block_size, 3, 64, torch.bfloat16)
    block_table = make_block_tables([seq_len], block_size, num_blocks)[0]
    q = torch.randn(num_queries, 9, 64).to(torch.bfloat16)
    assert attention._prefill_kernel_serves(q, cache.k, cache.v, None)

    out = attention.prefill_attention(q, cache.k, cache.v, block_table, seq_len, 0.125, sliding_window)
    monkeypatch.setattr(attention, "_prefill_kernel_serves", lambda *args: False)
    torch_out = attention.prefill_attention(q, cache.k, cache.v, block_table, seq_len, 0.125, sliding_window)

    assert out.dtype == torch_out.dtype == torch.bfloat16
    assert relative_error(out.float(), torch_out.float()) < TOLERANCE[torch.bfloat16]


def test_a_float32_or_fp8_prefill_keeps_the_torch_path() -> None:
    cache = make_cache(4, 16, 3, 64, torch.float32)
    q = torch.randn(5, 9, 64)
    assert not attention._prefill_kernel_serves(q, cache.k, cache.v, None)
    bf16 = make_cache(4, 16, 3, 64, torch.bfloat16)
    assert not attention._prefill_kernel_serves(q.bfloat16(), bf16.k, bf16.v, torch.zeros(4, 16, 3))
