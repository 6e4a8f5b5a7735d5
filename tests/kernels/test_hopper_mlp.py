"""engine/kernels/hopper_mlp.py: the gate_up GEMM with SiLU-and-mul in its epilogue (CUDA C++, Hopper only)."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from engine.kernels import hopper_mlp
from engine.kernels.layers import silu_and_mul

gpu = pytest.mark.gpu


def _hopper() -> None:
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper GPU (sm_90)")
    if not hopper_mlp.device_supported(torch.device("cuda")):
        pytest.skip("the kernel did not build here (no nvcc?)")


def _operands(rows: int, k: int, out_features: int, device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, k] and a weight [out_features, k] (for gate_up: 2I rows, gate then up)."""
    x = torch.randn(rows, k, device=device).to(torch.bfloat16)
    weight = (torch.randn(out_features, k, device=device) / k ** 0.5).to(torch.bfloat16)
    return x, weight


def _replayed(kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor,
              weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel captured in a CUDA graph (as the decode graphs capture it), replayed on new inputs: the replay's
    output, checked equal to an eager call on those inputs, and the inputs."""
    static_x = x.clone()
    kernel(static_x, weight)  # built and configured outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = kernel(static_x, weight)
    fresh = torch.randn_like(x.float()).to(torch.bfloat16)
    static_x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, kernel(fresh, weight))
    return static_out, fresh


def test_not_usable_off_hopper_or_off_shape() -> None:
    """On the CPU (CI) the kernel is never picked, and the shapes it does not take are refused before any build."""
    x, weight = _operands(128, 128, 2 * 112, device="cpu")
    assert not hopper_mlp.device_supported(torch.device("cpu"))
    assert not hopper_mlp.shape_supported(x, weight)
    with pytest.raises(ValueError, match="does not take"):
        hopper_mlp.gate_up_silu(x, weight)


@gpu
@pytest.mark.parametrize("rows", [128, 200, 256])
def test_equals_cublas_then_silu_and_mul(rows: int) -> None:
    """The fused result against the unfused path it replaces (cuBLAS's GEMM, then the Triton SiLU-and-mul) and
    against float64 math. 200 rows leaves a partial token tile; 336 = 3 x 112 features, K = 1024 is 16 blocks."""
    _hopper()
    x, weight = _operands(rows, 1024, 2 * 336)
    assert hopper_mlp.shape_supported(x, weight)
    out = hopper_mlp.gate_up_silu(x, weight)
    unfused = silu_and_mul(torch.nn.functional.linear(x, weight))
    assert out.shape == (rows, 336) and out.dtype == torch.bfloat16
    # the epilogue rounds as the unfused path does, so where the two GEMMs' float32 sums round to the same bf16
    # (nearly everywhere), the results are equal; elsewhere they differ by a bf16 rounding of the inputs
    equal = (out == unfused).float().mean().item()
    assert equal > 0.98, f"only {equal:.3f} of the outputs equal the unfused path's"
    gate, up = (x.double() @ weight.double().T).chunk(2, dim=-1)
    exact = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(out.double(), exact, rtol=2 ** -6, atol=2 ** -6 * exact.abs().max().item())
    torch.testing.assert_close(out.double(), unfused.double(), rtol=2 ** -6, atol=2 ** -6 * exact.abs().max().item())


@gpu
def test_at_llama_8b_shape_inside_a_cuda_graph() -> None:
    """The decode graphs capture it: a replay on new inputs gives the eager result."""
    _hopper()
    x, weight = _operands(256, 4096, 2 * 14336)
    static_out, fresh = _replayed(hopper_mlp.gate_up_silu, x, weight)
    unfused = silu_and_mul(torch.nn.functional.linear(fresh, weight))
    assert (static_out == unfused).float().mean().item() > 0.98


@gpu
def test_refuses_what_it_does_not_take() -> None:
    _hopper()
    x, weight = _operands(128, 1024, 2 * 336)
    assert not hopper_mlp.shape_supported(x[:32], weight)  # below the batches it was measured to win at
    assert not hopper_mlp.shape_supported(torch.cat([x] * 5), weight)  # above (640 rows)
    assert not hopper_mlp.shape_supported(x.half(), weight.half())
    assert not hopper_mlp.shape_supported(x[:, :1000], weight[:, :1000])  # K not a multiple of 64
    assert not hopper_mlp.shape_supported(x, weight[:, :1000])  # widths that differ
    assert not hopper_mlp.shape_supported(x, weight[:2 * 300])  # I not a multiple of 112
    assert not hopper_mlp.shape_supported(x.t().contiguous().t(), weight)  # not row-major
    with pytest.raises(ValueError, match="does not take"):
        hopper_mlp.gate_up_silu(x[:32], weight)


@gpu
def test_the_mlp_takes_the_kernel_and_matches_it_without() -> None:
    """llama.MLP as the runner sets it up on a Hopper GPU: the fused kernel, then the down projection (bit-equal to
    calling them), and within bf16 rounding of the module without the kernel."""
    _hopper()
    from engine.model.llama import MLP

    cfg = SimpleNamespace(hidden_size=1024, intermediate_size=2240, mlp_bias=False)  # what MLP reads
    mlp = MLP(cfg, fused=True).to(device="cuda", dtype=torch.bfloat16)  # type: ignore[arg-type]
    torch.nn.init.normal_(mlp.gate_up_proj.weight, std=1024 ** -0.5)
    torch.nn.init.normal_(mlp.down_proj.weight, std=2240 ** -0.5)
    x = torch.randn(256, 1024, device="cuda").to(torch.bfloat16)
    plain = mlp(x)
    mlp.gate_up_silu = True
    fused = mlp(x)
    by_hand = mlp.down_proj(hopper_mlp.gate_up_silu(x, mlp.gate_up_proj.weight))
    assert torch.equal(fused, by_hand)
    torch.testing.assert_close(fused.float(), plain.float(), rtol=2 ** -6, atol=2 ** -6 * plain.abs().max().item())
