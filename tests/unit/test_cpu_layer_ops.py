"""The CPU's fused layer ops (engine/layers/cpu_layer_ops.cpp) against the torch ops they replace: RoPE with the K/V
store and the residual add bit for bit; RMSNorm and SiLU-and-mul in bf16 and fp16 to the last bit but where their
float32 sum of squares or exp (computed in another order than torch's) puts a value across a rounding boundary."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.config import RopeConfig
from engine.layers import cpu_kernels
from engine.layers.attention import store_kv
from engine.layers.basic import RMSNorm, RotaryEmbedding, silu_and_mul

pytestmark = pytest.mark.skipif(shutil.which("c++") is None or shutil.which("ninja") is None,
                                reason="no C++ compiler or ninja to build the CPU kernels with")

HALVES = [torch.bfloat16, torch.float16]


def _assert_rounded_alike(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal, but for a few values (at most 1 in 500) a rounding or two apart (RMSNorm's weight scales a normed value
    that was rounded the other way, and that product is rounded again)."""
    differ = out != expected
    assert differ.float().mean() <= 2e-3, f"{int(differ.sum())} of {out.numel()} values differ"
    two_roundings = 2 * torch.finfo(out.dtype).eps * expected[differ].float().abs()
    assert ((out[differ].float() - expected[differ].float()).abs() <= two_roundings).all()


def _torch_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch ops' result: the module's own path with the C++ op switched off."""
    summed = x if residual is None else x + residual
    normed = torch.nn.functional.rms_norm(summed.float(), (x.shape[-1],), eps=norm.eps)
    return norm.weight * normed.to(x.dtype), summed


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("rows", [1, 8, 203])  # 203 rows: split over the threads
@pytest.mark.parametrize("hidden", [576, 70])  # 70: a scalar tail after the vector loop
def test_rms_norm_with_the_residual_add_rounds_as_torch(dtype: torch.dtype, rows: int, hidden: int) -> None:
    torch.manual_seed(rows + hidden)
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    norm.weight.data = (torch.randn(hidden) * 0.3 + 1).to(dtype)
    x, residual = (torch.randn(rows, hidden) * 3).to(dtype), torch.randn(rows, hidden).to(dtype)
    assert cpu_kernels.layer_ops_serve(x, float32=False)
    out, summed = norm.add_and_norm(x, residual)  # through the C++ op
    expected, expected_sum = _torch_norm(norm, x, residual)
    assert torch.equal(summed, expected_sum)
    _assert_rounded_alike(out, expected)
    _assert_rounded_alike(norm(x), _torch_norm(norm, x, None)[0])


def test_rms_norm_takes_rows_that_are_not_contiguous() -> None:
    norm = RMSNorm(64, 1e-6).to(torch.bfloat16)
    norm.weight.data = torch.randn(64).to(torch.bfloat16)
    heads = torch.randn(5, 4 * 64).to(torch.bfloat16)[:, 64:].view(5, 3, 64)  # q-norm's view of a fused q/k/v row
    _assert_rounded_alike(norm(heads), _torch_norm(norm, heads, None)[0])


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("width", [1536, 36])
def test_silu_and_mul_rounds_as_torch(dtype: torch.dtype, width: int) -> None:
    torch.manual_seed(width)
    gate_up = (torch.randn(37, 2 * width) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    _assert_rounded_alike(silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, *HALVES])
def test_rope_and_the_kv_store_are_bit_equal_to_torch(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    tokens, num_heads, num_kv_heads, head_dim, block_size = 37, 9, 3, 64, 16
    rope = RotaryEmbedding(RopeConfig(theta=100000.0), head_dim, 2048)
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (x.view(tokens, -1, head_dim) for x in (q, k, v))  # strided views, as the layer has them
    positions = torch.randint(0, 2048, (tokens,))
    slots = torch.randperm(20 * block_size)[:tokens]
    # the engine's pool layout: [blocks, Hkv, layers, 2, block_size, D]; a layer's K and V are strided views
    pool = torch.zeros(20, num_kv_heads, 2, 2, block_size, head_dim, dtype=dtype)
    expected_pool = pool.clone()
    expected_q, expected_k = (x.clone() for x in rope(positions, q, k))  # the torch path (RoPE is never fused)
    store_kv(expected_k, v, expected_pool[:, :, 1, 0].transpose(1, 2), expected_pool[:, :, 1, 1].transpose(1, 2), slots)
    cpu_kernels.rotary_and_store_kv(positions, q, k, v, rope.cos_sin, pool[:, :, 1, 0].transpose(1, 2),
                                    pool[:, :, 1, 1].transpose(1, 2), slots)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(pool, expected_pool)


def test_a_position_or_slot_out_of_range_is_an_error_not_a_write() -> None:
    rope = RotaryEmbedding(RopeConfig(theta=10000.0), 8, 16)
    q, k, v = torch.zeros(1, 2, 8), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        cpu_kernels.rotary_and_store_kv(torch.tensor([16]), q, k, v, rope.cos_sin)
    cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_kernels.rotary_and_store_kv(torch.tensor([3]), q, k, v, rope.cos_sin, cache, cache.clone(),
                                        torch.tensor([8]))
    assert not cache.any()
