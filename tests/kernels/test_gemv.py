from __future__ import annotations

import pytest
import torch

from engine.kernels.gemv import gemv
from engine.kernels.layers import silu_and_mul

gpu = pytest.mark.gpu


def _check(k: int, n: int, dtype: torch.dtype, device: str, bias: bool, silu: bool, **config: int) -> None:
    x = torch.randn(1, 2 * k if silu else k, device=device).to(dtype)
    weight = (torch.randn(n, k, device=device) / k ** 0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    out = gemv(x, weight, b, silu_mul_input=silu, **config)
    # the oracle: the same bf16 inputs in float64 (SiLU-and-mul as the separate kernel rounds it)
    inputs = silu_and_mul(x) if silu else x
    expected = inputs.double() @ weight.double().T + (b.double() if b is not None else 0)
    assert out.shape == (1, n) and out.dtype == dtype
    # one rounding of the float32 sum to the output dtype, plus float32 accumulation order
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2 ** -8}[dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("bias", "silu"), [(False, False), (True, False), (False, True)])
def test_gemv_matches_float64_math_with_ragged_edges(dtype: torch.dtype, bias: bool, silu: bool) -> None:
    # 37 rows and 100 columns leave partial tiles in both directions
    _check(100, 37, dtype, "cpu", bias, silu, block_n=8, block_k=32)


def test_gemv_refuses_a_batch_or_mismatched_width() -> None:
    with pytest.raises(ValueError, match="gemv shapes"):
        gemv(torch.randn(2, 16), torch.randn(4, 16))
    with pytest.raises(ValueError, match="gate and up"):
        gemv(torch.randn(1, 16), torch.randn(4, 16), silu_mul_input=True)


@gpu
@pytest.mark.parametrize(("k", "n", "silu"), [(4096, 6144, False), (4096, 4096, False), (14336, 4096, True)])
def test_gemv_on_gpu_at_llama_8b_shapes(k: int, n: int, silu: bool) -> None:
    _check(k, n, torch.bfloat16, "cuda", False, silu)

