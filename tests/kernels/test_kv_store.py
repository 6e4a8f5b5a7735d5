from __future__ import annotations

import pytest
import torch

from engine.config import RopeConfig
from engine.kernels import reference
from engine.kernels.kv_store import rotary_and_store_kv, store_kv
from engine.kernels.layers import rotary_embedding
from engine.layers.basic import RotaryEmbedding
from tests.kernels.paged import make_cache

gpu = pytest.mark.gpu


def _check_store(num_tokens: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: str) -> None:
    num_blocks = max(64, 2 * num_tokens // block_size)
    cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    expected = cache.clone()
    # k and v as strided views of a fused qkv projection, like the model produces them
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, device=device).to(dtype)
    k, v = qkv[:, num_kv_heads:2 * num_kv_heads], qkv[:, 2 * num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[::5] = -1  # padding tokens store nothing
    store_kv(k, v, cache.k, cache.v, slots)
    reference.store_kv(k, v, expected.k, expected.v, slots)
    assert torch.equal(cache.kv, expected.kv)  # other layers untouched, stored rows exact


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_scatters_rows_into_their_slots_through_strided_views(block_size: int, dtype: torch.dtype
                                                                       ) -> None:
    _check_store(13, block_size, 2, 32, dtype, "cpu")


def test_store_kv_handles_non_power_of_two_heads_and_dims() -> None:
    _check_store(7, 16, 3, 24, torch.float32, "cpu")


def test_store_kv_rejects_mismatched_shapes() -> None:
    cache = make_cache(4, 4, 2, 16, torch.float32)
    k = torch.randn(3, 2, 16)
    with pytest.raises(ValueError, match="shapes disagree"):
        store_kv(k, k, cache.k, cache.v, torch.arange(4))


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_store_kv_on_gpu_matches_reference(dtype: torch.dtype) -> None:
    _check_store(4096, 16, 8, 128, dtype, "cuda")


def _check_rotary_and_store(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                            device: str) -> None:
    block_size, num_blocks = 16, max(64, 2 * num_tokens // 16)
    cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    expected = cache.clone()
    # q, k, v as strided views of a fused qkv projection, like the model produces them
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, device=device).to(dtype)
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    rope = RotaryEmbedding(RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0), head_dim,
                           max_positions=4096).to(device)
    positions = torch.randint(0, 4096, (num_tokens,), device=device)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[::5] = -1  # padding tokens store nothing
    q_out, k_out = rotary_and_store_kv(positions, q, k, v, rope.cos_sin, cache.k, cache.v, slots)
    # the oracle: the two kernels it fuses, bit for bit
    q_ref, k_ref = rotary_embedding(positions, q, k, rope.cos_sin)
    store_kv(k_ref, v, expected.k, expected.v, slots)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert torch.equal(cache.kv, expected.kv)  # other layers untouched, stored rows exact


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_and_store_equals_rotary_then_store(dtype: torch.dtype) -> None:
    _check_rotary_and_store(11, 4, 2, 32, dtype, "cpu")


def test_rotary_and_store_handles_non_power_of_two_heads() -> None:
    _check_rotary_and_store(7, 6, 3, 24, torch.float32, "cpu")


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rotary_and_store_on_gpu_equals_rotary_then_store(dtype: torch.dtype) -> None:
    _check_rotary_and_store(4096, 32, 8, 128, dtype, "cuda")
