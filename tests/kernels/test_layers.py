from __future__ import annotations

import pytest
import torch

from engine.config import RopeConfig
from engine.kernels import reference
from engine.kernels.layers import rms_norm, rotary_embedding, silu_and_mul
from engine.layers.basic import RMSNorm, RotaryEmbedding
from engine.layers.basic import silu_and_mul as layer_silu_and_mul
from tests.kernels.paged import relative_error

gpu = pytest.mark.gpu
DTYPES = [torch.float32, torch.bfloat16]
# Elementwise bound, in units of the dtype's last place: on a GPU the kernels round where torch rounds, so
# one unit covers float32 reduction order; the CPU interpreter truncates to bf16 instead of rounding, and
# its errors add up over a kernel's few roundings.
ULP = {torch.float32: 1e-5, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}


def _assert_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape
    tolerance = ULP[out.dtype] * (1 if out.is_cuda or out.dtype == torch.float32 else 4)
    torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=tolerance)


def _check_rms_norm(num_tokens: int, hidden: int, dtype: torch.dtype, device: str) -> None:
    x = torch.randn(num_tokens, hidden, device=device).to(dtype)
    residual = torch.randn(num_tokens, hidden, device=device).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    _assert_close(rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))
    out, new_residual = rms_norm(x, weight, 1e-6, residual)
    expected_out, expected_residual = reference.rms_norm(x, weight, 1e-6, residual)
    _assert_close(out, expected_out)
    _assert_close(new_residual, expected_residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 100])
def test_rms_norm_matches_reference_with_and_without_residual(dtype: torch.dtype, hidden: int) -> None:
    _check_rms_norm(5, hidden, dtype, "cpu")


def test_rms_norm_matches_the_engine_layer() -> None:
    layer = RMSNorm(48, eps=1e-5)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48))
        x = torch.randn(2, 3, 48)
        _assert_close(rms_norm(x, layer.weight, layer.eps), layer(x))


def _check_rotary(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  device: str) -> None:
    # q and k as strided views of a fused qkv projection
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, device=device).to(dtype)
    q, k = qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads]
    rope = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, max_positions=4096).to(device)
    positions = torch.randint(0, 4096, (num_tokens,), device=device)
    q_out, k_out = rotary_embedding(positions, q, k, rope.cos_sin)
    q_ref, k_ref = reference.rotary_embedding(positions, q, k, rope.cos_sin)
    _assert_close(q_out, q_ref)
    _assert_close(k_out, k_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_matches_reference_on_strided_views(dtype: torch.dtype) -> None:
    _check_rotary(6, 4, 2, 32, dtype, "cpu")


def test_rotary_embedding_matches_the_engine_layer() -> None:
    rope = RotaryEmbedding(RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0), 24, max_positions=64)
    positions = torch.tensor([0, 5, 63, 17])
    q, k = torch.randn(4, 3, 24), torch.randn(4, 1, 24)
    q_out, k_out = rotary_embedding(positions, q, k, rope.cos_sin)
    q_ref, k_ref = rope(positions, q, k)
    _assert_close(q_out, q_ref)
    _assert_close(k_out, k_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype: torch.dtype) -> None:
    x = torch.randn(4, 2 * 70).to(dtype)
    _assert_close(silu_and_mul(x), reference.silu_and_mul(x))
    _assert_close(silu_and_mul(x), layer_silu_and_mul(x))


def test_layers_accept_empty_batches() -> None:
    x = torch.randn(0, 32)
    assert rms_norm(x, torch.ones(32), 1e-6).shape == (0, 32)
    assert silu_and_mul(x).shape == (0, 16)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_layers_on_gpu_llama_shapes(dtype: torch.dtype) -> None:
    _check_rms_norm(2000, 4096, dtype, "cuda")
    _check_rotary(2000, 32, 8, 128, dtype, "cuda")
    x = torch.randn(2000, 2 * 14336, device="cuda").to(dtype)
    _assert_close(silu_and_mul(x), reference.silu_and_mul(x))
    assert relative_error(silu_and_mul(x).float(), reference.silu_and_mul(x).float()) < 1e-3
