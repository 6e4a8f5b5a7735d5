"""The Triton kernels on an FP8 cache (engine/layers/kv_fp8.py) against their torch twins: the store kernel writes
the twin's bytes exactly (values and scales), decode and prefill attention over e4m3 K/V agree with the twins, and
TritonAttention with TorchAttention through a whole mixed step."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import reference
from engine.kernels.backend import TritonAttention
from engine.kernels.decode import DecodeConfig, paged_decode_attention
from engine.kernels.kv_store import store_kv
from engine.kernels.prefill import paged_prefill_attention
from engine.layers import kv_fp8
from engine.layers.attention import AttentionMetadata, KVCacheLayer, TorchAttention
from tests.kernels.paged import TOLERANCE, int32, make_block_tables, relative_error

gpu = pytest.mark.gpu


def fp8_pool(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, device: str = "cpu",
             layer: int = 1) -> tuple[torch.Tensor, KVCacheLayer]:
    """A two-layer FP8 pool of random bytes (so a row written where it should not be shows) and one layer's views.
    The bytes stay below 0x7F: finite e4m3 values and scales, as a pool the engine wrote holds (the torch backend
    gathers whole blocks and masks the slots past a sequence's end, and a masked NaN would still poison it)."""
    pool, views = kv_fp8.allocate_fp8_pool(num_blocks, 2, block_size, num_kv_heads, head_dim, device)
    pool.copy_(torch.randint(0, 0x7F, pool.shape, dtype=torch.uint8))
    return pool, KVCacheLayer(*views[layer])


def layer_views(pool: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int, layer: int = 1
                ) -> KVCacheLayer:
    scale_offset = kv_fp8.region_geometry(block_size, head_dim)[0]
    return KVCacheLayer(*kv_fp8.fp8_views(pool[:, :, layer], block_size, head_dim, scale_offset))


def spread_rows(num_tokens: int, num_heads: int, head_dim: int, device: str) -> torch.Tensor:
    """[T, H, D] rows whose magnitudes span ~10 orders (row scales from 2**-17 to 2**17): every scale exponent path,
    and values far past e4m3's 448 that must not saturate."""
    magnitudes = torch.exp2(torch.randint(-17, 18, (num_tokens, num_heads, 1)).float())
    return (torch.randn(num_tokens, num_heads, head_dim) * magnitudes).to(device)


def filled_cache(seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, device: str
                 ) -> tuple[KVCacheLayer, torch.Tensor]:
    """An FP8 layer whose blocks hold quantized K/V for every slot (stored by the twin), and scattered tables."""
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 8
    _, cache = fp8_pool(num_blocks, block_size, num_kv_heads, head_dim, device)
    rows = spread_rows(num_blocks * block_size, 2 * num_kv_heads, head_dim, "cpu").clamp(-1e3, 1e3).to(device)
    slots = torch.arange(num_blocks * block_size, device=device)
    reference.store_kv(rows[:, :num_kv_heads], rows[:, num_kv_heads:], cache.k, cache.v, slots, cache.k_scale,
                       cache.v_scale)
    return cache, make_block_tables(seq_lens, block_size, num_blocks, device)


def check_store(num_tokens: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: str) -> None:
    num_blocks = max(16, 2 * num_tokens // block_size)
    pool, cache = fp8_pool(num_blocks, block_size, num_kv_heads, head_dim, device)
    expected_pool = pool.clone()
    expected = layer_views(expected_pool, block_size, num_kv_heads, head_dim)
    # k and v as strided views of a fused qkv projection, like the model produces them
    qkv = spread_rows(num_tokens, 3 * num_kv_heads, head_dim, device)
    # a value 2**-20 of another in its row rounds to zero: its sign must survive (-0.0 is byte 0x80, as torch casts)
    qkv[:, :, 1] = -qkv[:, :, 0].abs() * 2 ** -20
    qkv = qkv.to(dtype)
    k, v = qkv[:, num_kv_heads:2 * num_kv_heads], qkv[:, 2 * num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[::5] = -1  # padding tokens store nothing
    store_kv(k, v, cache.k, cache.v, slots, cache.k_scale, cache.v_scale)
    reference.store_kv(k, v, expected.k, expected.v, slots, expected.k_scale, expected.v_scale)
    assert torch.equal(pool, expected_pool)  # byte for byte: values, scales, padding and the other layer


def test_fp8_store_writes_the_twins_bytes_values_and_scales() -> None:
    check_store(9, 4, 3, 24, torch.bfloat16, "cpu")


def check_attention(seq_lens: list[int], query_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                    block_size: int, dtype: torch.dtype, sliding_window: int | None, device: str,
                    decode_config: DecodeConfig | None = None) -> None:
    cache, tables = filled_cache(seq_lens, block_size, num_kv_heads, head_dim, device)
    lens = int32(seq_lens, device)
    scale = head_dim ** -0.5
    q = torch.randn(len(seq_lens), num_heads, head_dim, device=device).to(dtype)
    out = paged_decode_attention(q, cache.k, cache.v, tables, lens, scale, sliding_window, config=decode_config,
                                 k_scale=cache.k_scale, v_scale=cache.v_scale)
    expected = reference.paged_decode_attention(q, cache.k, cache.v, tables, lens, scale, sliding_window,
                                                cache.k_scale, cache.v_scale)
    assert relative_error(out, expected) < TOLERANCE[dtype]

    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], num_heads, head_dim, device=device).to(dtype)
    out = paged_prefill_attention(q, cache.k, cache.v, tables, int32(starts, device), lens, scale, sliding_window,
                                  k_scale=cache.k_scale, v_scale=cache.v_scale)
    expected = reference.paged_prefill_attention(q, cache.k, cache.v, tables, int32(starts, device), lens, scale,
                                                 sliding_window, cache.k_scale, cache.v_scale)
    assert relative_error(out, expected) < TOLERANCE[dtype]


def test_fp8_decode_and_prefill_match_the_twins_over_partitions_and_a_cached_prefix() -> None:
    check_attention([1, 19, 37], [1, 5, 20], 4, 2, 16, 4, torch.float32, None, "cpu",
                    DecodeConfig(block_n=16, partition_size=16))


def test_fp8_kernels_refuse_a_cache_without_both_scales() -> None:
    cache, tables = filled_cache([5], 4, 2, 16, "cpu")
    q = torch.randn(1, 2, 16)
    with pytest.raises(ValueError, match="both scales"):
        paged_decode_attention(q, cache.k, cache.v, tables, int32([5]), 0.25, None, k_scale=cache.k_scale)


def mixed_step(cache: KVCacheLayer, block_size: int, num_kv_heads: int, head_dim: int, num_heads: int,
               dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Two decodes and two prefill chunks (one with a cached prefix): q, k, v and metadata for a backend."""
    context = [9, 30, 12, 21]  # tokens before this step
    new = [1, 1, 12, 5]  # the third sequence is a fresh prompt, the fourth continues after a prefix
    context = [c if n == 1 else c - n for c, n in zip(context, new, strict=True)]
    seq_lens = [c + n for c, n in zip(context, new, strict=True)]
    num_blocks = cache.k.shape[0]
    tables = make_block_tables(seq_lens, block_size, num_blocks, device)
    slots: list[int] = []
    for b, (start, n) in enumerate(zip(context, new, strict=True)):
        slots += [int(tables[b, p // block_size]) * block_size + p % block_size for p in range(start, start + n)]
        old = [int(tables[b, p // block_size]) * block_size + p % block_size for p in range(start)]
        rows = spread_rows(len(old), 2 * num_kv_heads, head_dim, "cpu").clamp(-1e3, 1e3).to(device)
        reference.store_kv(rows[:, :num_kv_heads], rows[:, num_kv_heads:], cache.k, cache.v,
                           torch.tensor(old, dtype=torch.int64, device=device), cache.k_scale, cache.v_scale)
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
                             query_start_loc=int32(starts, device), seq_lens=int32(seq_lens, device),
                             block_tables=tables, num_decodes=2, query_start_loc_host=starts, seq_lens_host=seq_lens)
    q = torch.randn(starts[-1], num_heads, head_dim, device=device).to(dtype)
    kv = torch.randn(starts[-1], 2 * num_kv_heads, head_dim, device=device).to(dtype)
    return q, kv[:, :num_kv_heads], kv[:, num_kv_heads:], meta


def check_backend(block_size: int, num_kv_heads: int, head_dim: int, num_heads: int, dtype: torch.dtype,
                  device: str) -> None:
    pool, cache = fp8_pool(24, block_size, num_kv_heads, head_dim, device)
    q, k, v, meta = mixed_step(cache, block_size, num_kv_heads, head_dim, num_heads, dtype, device)
    torch_pool = pool.clone()
    torch_cache = layer_views(torch_pool, block_size, num_kv_heads, head_dim)
    scale = head_dim ** -0.5
    expected = TorchAttention().forward(q, k, v, torch_cache.k, torch_cache.v, meta, scale,
                                        k_scale=torch_cache.k_scale, v_scale=torch_cache.v_scale)
    out = TritonAttention().forward(q, k, v, cache.k, cache.v, meta, scale, k_scale=cache.k_scale,
                                    v_scale=cache.v_scale)
    assert torch.equal(pool, torch_pool)  # both stored the step's rows alike
    assert relative_error(out, expected) < TOLERANCE[dtype]


def test_fp8_triton_backend_matches_the_torch_backend_on_a_mixed_step() -> None:
    check_backend(4, 2, 16, 4, torch.float32, "cpu")


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_store_on_gpu_writes_the_twins_bytes(dtype: torch.dtype) -> None:
    check_store(4096, 16, 8, 128, dtype, "cuda")


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_attention_on_gpu_matches_the_twins(dtype: torch.dtype) -> None:
    check_attention([1, 300, 2000, 777], [1, 64, 300, 129], 32, 8, 128, 16, dtype, None, "cuda")


@gpu
def test_fp8_triton_backend_on_gpu_matches_the_torch_backend() -> None:
    check_backend(16, 8, 128, 32, torch.bfloat16, "cuda")
