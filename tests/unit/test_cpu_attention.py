"""The torch (CPU) attention backend and the in-place CPU decode kernel against the plain einsum oracle, and the
CPU's packed (oneDNN) linear layers."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import reference
from engine.layers import cpu_kernels, cpu_paged_attention
from engine.layers.attention import AttentionMetadata, TorchAttention
from engine.layers.cpu_linear import PackedLinear, pack_cpu_linears, packed_compute_dtype
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from tests.kernels.paged import TOLERANCE, int32, make_block_tables, make_cache, relative_error

ROOT = Path(__file__).resolve().parents[2]


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


needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 8, 65, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_float32_linear_is_the_linear_product_at_every_row_count(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(96, 300, bias=bias)
    x = torch.randn(rows, 96)
    out = PackedLinear(linear, torch.float32)(x)
    exact = linear.double()(x.double())
    assert out.shape == (rows, 300) and out.dtype == torch.float32
    # float32 summation order only: a few ulps of the largest partial sum (|w| |x| summed over 96 terms)
    bound = 1e-5 * (x.double().abs() @ linear.weight.double().abs().T) + 1e-6
    assert ((out.double() - exact).abs() <= bound).all()


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_half_linear_rounds_like_a_float32_accumulating_matmul(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=True).to(dtype)
    x = torch.randn(7, 96).to(dtype)
    out = PackedLinear(linear, packed_compute_dtype(dtype))(x)  # float32 where oneDNN has no path for dtype
    exact = F.linear(x.double(), linear.weight.double(), linear.bias.double())
    assert out.dtype == dtype
    # only the final rounding to 16 bits (half an ulp: 2^-9 relative for bf16) and float32 summation errors
    assert ((out.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-5).all()


@pytest.mark.skipif(not cpu_kernels.has_bf16_dot(), reason="no AVX512-BF16 (or no compiler): bf16 layers take oneDNN")
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 17, 300])  # the kernel's blocks of 8 rows, and their remainders
@pytest.mark.parametrize(("in_features", "out_features"), [(96, 70), (576, 64)])  # a part tile of outputs; whole
def test_bf16_tiles_are_a_float32_accumulating_bf16_matmul(rows: int, in_features: int, out_features: int) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(in_features, out_features, bias=rows % 2 == 1).to(torch.bfloat16)
    packed = PackedLinear(linear, torch.bfloat16)
    assert packed.tiles is not None and packed.packed is None
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    out = packed(x)
    exact = F.linear(x.double(), linear.weight.double(), None if linear.bias is None else linear.bias.double())
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
    # the final rounding to bf16 (half an ulp, 2^-9 relative) and float32 summation errors of |w| |x| summed
    bound = exact.abs() * 2.0 ** -8 + 1e-5 * (x.double().abs() @ linear.weight.double().abs().T)
    assert ((out.double() - exact).abs() <= bound).all()
    # a batch of token rows [B, T, K] is the same product row by row
    assert torch.equal(packed(x.view(1, rows, in_features))[0], out)


@pytest.mark.skipif(not cpu_kernels.has_bf16_dot(), reason="no AVX512-BF16 here (or no compiler)")
def test_a_bf16_layer_with_an_odd_input_size_keeps_onednn() -> None:
    packed = PackedLinear(nn.Linear(7, 4).to(torch.bfloat16), torch.bfloat16)
    assert packed.tiles is None and packed.packed is not None


class _Scaled(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


@needs_onednn
def test_pack_cpu_linears_replaces_plain_and_parallel_linears_only() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16), nn.Sequential(nn.Linear(8, 4).to(torch.float16)),
                          ColumnParallelLinear(4, 6, bias=False), RowParallelLinear(6, 4, bias=True), _Scaled(4, 4),
                          nn.Linear(4, 4).to(torch.float64))
    x = torch.randn(3, 4)
    expected = model[5](model[4](model[3](model[2](x))).double())
    assert pack_cpu_linears(model) == 4
    assert all(isinstance(model[i], PackedLinear) for i in (0, 2, 3)) and isinstance(model[1][0], PackedLinear)
    assert type(model[4]) is _Scaled and type(model[5]) is nn.Linear  # own forward; a dtype oneDNN lacks
    assert model[1][0](torch.ones(1, 8, dtype=torch.float16)).dtype == torch.float16
    assert model[0](torch.ones(2, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16
    torch.testing.assert_close(model[5](model[4](model[3](model[2](x))).double()), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(shutil.which("c++") is None or shutil.which("ninja") is None,
                    reason="no C++ compiler or ninja to build the CPU kernel with")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# groups of 3 and 1 query heads, and 4 and 6, which the AVX512-BF16 walk takes several heads at a time
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "sliding_window"),
                         [(9, 3, None), (4, 4, 7), (8, 2, None), (12, 2, 5)])
# head sizes: 64 values held in registers, then 8 at a time (72), and a scalar tail (20); 64 and 128 also take the
# AVX512-BF16 walk for a bf16 cache where the CPU has it; blocks of 4 and 16 tokens
@pytest.mark.parametrize(("head_dim", "block_size"), [(16, 4), (72, 16), (20, 16), (64, 16), (128, 4)])
def test_the_in_place_cpu_decode_kernel_matches_the_oracle(dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                                                           sliding_window: int | None, head_dim: int,
                                                           block_size: int) -> None:
    # where a compiler is there, the kernel must build: else every CPU decode would quietly take the slow path
    assert cpu_kernels.kernel() is not None
    torch.manual_seed(1)
    query_lens = [1, 1, 1, 1]
    seq_lens = [21, 4, 33, 1]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 8
    cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)  # K and V interleaved: strided
    meta = _step(query_lens, seq_lens, len(seq_lens), block_size, num_blocks, sliding_window)
    q = torch.randn(len(seq_lens), num_heads, head_dim).to(dtype)
    assert cpu_paged_attention.serves(q, cache.k, None)
    out = cpu_paged_attention.paged_decode_attention(q, cache.k, cache.v, meta.block_tables, meta.seq_lens,
                                                     head_dim ** -0.5, sliding_window)
    expected = reference.paged_prefill_attention(q, cache.k, cache.v, meta.block_tables, meta.query_start_loc,
                                                 meta.seq_lens, head_dim ** -0.5, sliding_window)
    assert out.dtype == dtype and out.shape == q.shape
    assert relative_error(out.float(), expected.float()) < TOLERANCE[dtype]


@pytest.mark.skipif(shutil.which("c++") is None or shutil.which("ninja") is None,
                    reason="no C++ compiler or ninja to build the CPU kernel with")
def test_a_built_kernel_loads_although_a_killed_process_left_the_build_lock() -> None:
    module = cpu_kernels.kernel()
    assert module is not None
    lock = Path(module.__file__).parent / "lock"
    lock.touch()  # what a node killed inside torch's build step leaves behind
    try:
        loaded = subprocess.run([sys.executable, "-c", "from engine.layers import cpu_kernels as c; "
                                 "print(c.kernel() is not None)"], cwd=ROOT, capture_output=True, text=True,
                                timeout=60)
    finally:
        lock.unlink(missing_ok=True)
    assert loaded.stdout.strip() == "True", loaded.stderr
