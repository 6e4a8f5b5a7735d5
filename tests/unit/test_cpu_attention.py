"""The torch (CPU) attention backend against the plain einsum oracle, the widened half-precision linears and the
CPU's few-rows product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import reference
from engine.layers.attention import AttentionMetadata, TorchAttention
from engine.layers.cpu_linear import WidenedLinear, has_half_dot_product, widen_half_linears
from engine.layers.linear import CPU_FEW_ROWS, ColumnParallelLinear, RowParallelLinear, dense_linear
from tests.kernels.paged import TOLERANCE, int32, make_block_tables, make_cache, relative_error


def _step(query_lens: list[int], seq_lens: list[int], num_decodes: int, block_size: int, num_blocks: int,
          sliding_window: int | None) -> AttentionMetadata:
    block_tables = make_block_tables(seq_lens, block_size, num_blocks)
    starts = [sum(query_lens[:b]) for b in range(len(query_lens) + 1)]
    slots = [int(block_tables[b, pos // block_size]) * block_size + pos % block_size
             for b, (num_queries, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True))
             for pos in range(seq_len - num_queries, seq_len)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc=int32(starts),
        seq_lens=int32(seq_lens), block_tables=block_tables, num_decodes=num_decodes,
        query_start_loc_host=starts, seq_lens_host=seq_lens, sliding_window=sliding_window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "sliding_window"), [(9, 3, None), (4, 4, None), (6, 2, 7)])
def test_torch_backend_matches_the_oracle_on_a_mixed_step(dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                                                          sliding_window: int | None) -> None:
    torch.manual_seed(0)
    # three decodes of different lengths (one past its last full block), a fresh prompt and a later chunk
    query_lens, seq_lens, num_decodes = [1, 1, 1, 13, 5], [21, 4, 33, 13, 30], 3
    block_size, head_dim = 4, 16
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 8
    cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    oracle_cache = cache.clone()
    meta = _step(query_lens, seq_lens, num_decodes, block_size, num_blocks, sliding_window)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    scale = head_dim ** -0.5

    out = TorchAttention().forward(q, k, v, cache.k, cache.v, meta, scale)

    reference.store_kv(k, v, oracle_cache.k, oracle_cache.v, meta.slot_mapping)
    assert torch.equal(cache.kv, oracle_cache.kv)
    expected = reference.paged_prefill_attention(q, oracle_cache.k, oracle_cache.v, meta.block_tables,
                                                 meta.query_start_loc, meta.seq_lens, scale, sliding_window)
    assert out.dtype == dtype
    assert relative_error(out.float(), expected.float()) < TOLERANCE[dtype]


def test_widened_linear_rounds_like_a_float32_accumulating_bf16_matmul() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=True).to(torch.bfloat16)
    x = torch.randn(7, 96).to(torch.bfloat16)
    out = WidenedLinear(linear)(x)
    exact = F.linear(x.double(), linear.weight.double(), linear.bias.double())
    assert out.dtype == torch.bfloat16
    # only the final rounding to bf16 (half an ulp: 2^-9 relative) and float32 summation errors remain
    assert ((out.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-6).all()


@pytest.mark.skipif(has_half_dot_product(), reason="this CPU multiplies bf16 natively: nothing is widened")
def test_widen_half_linears_replaces_only_half_precision_linears() -> None:
    model = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16), nn.Sequential(nn.Linear(8, 4).to(torch.float16)),
                          nn.Linear(4, 4))
    assert widen_half_linears(model) == 2
    assert isinstance(model[0], WidenedLinear) and isinstance(model[1][0], WidenedLinear)
    assert isinstance(model[2], nn.Linear) and model[2].weight.dtype == torch.float32
    assert model[1][0].weight.dtype == torch.float32
    assert model[1][0](torch.ones(1, 8, dtype=torch.float16)).dtype == torch.float16


@pytest.mark.parametrize("rows", [1, 2, 8, CPU_FEW_ROWS, CPU_FEW_ROWS + 1, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_dense_linear_is_the_linear_product_at_every_row_count(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    weight, x = torch.randn(300, 96), torch.randn(rows, 96)
    b = torch.randn(300) if bias else None
    out = dense_linear(x, weight, b)
    exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
    assert out.shape == (rows, 300) and out.dtype == torch.float32 and out.is_contiguous()
    # float32 summation order only: a few ulps of the largest partial sum (|w| |x| summed over 96 terms)
    assert ((out.double() - exact).abs() <= 1e-5 * (x.double().abs() @ weight.double().abs().T) + 1e-6).all()
    if not 1 < rows <= CPU_FEW_ROWS:  # outside the few-rows case it is F.linear itself, bit for bit
        assert torch.equal(out, F.linear(x, weight, b))


@pytest.mark.skipif(has_half_dot_product(), reason="this CPU multiplies bf16 natively: nothing is widened")
def test_column_parallel_layers_are_widened_and_row_parallel_ones_kept() -> None:
    model = nn.Sequential(ColumnParallelLinear(8, 8, bias=False).to(torch.bfloat16),
                          RowParallelLinear(8, 8, bias=False).to(torch.bfloat16))
    assert widen_half_linears(model) == 1
    assert isinstance(model[0], WidenedLinear) and isinstance(model[1], RowParallelLinear)
