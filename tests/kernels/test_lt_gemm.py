"""The GEMMs picked by timing (engine/kernels/lt_gemm.py): the choice rule on the CPU; on a GPU, cuBLASLt's
product against float64 math, inside a CUDA graph as a decode step runs it, and every case that must fall back to
F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.lt_gemm import pick
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear

gpu = pytest.mark.gpu


def test_pick_keeps_f_linear_unless_a_candidate_beats_it_by_the_margin() -> None:
    assert pick(100.0, [], 0.02) is None
    assert pick(100.0, [99.0, 101.0], 0.02) is None  # 1% faster: within the margin
    assert pick(100.0, [99.0, 97.0, 97.5], 0.02) == 1
    assert pick(100.0, [float("inf"), 90.0], 0.02) == 1  # a candidate that failed to launch never wins
    assert pick(100.0, [100.0], -1.0) == 0  # a negative margin takes the fastest candidate whatever F.linear does


class _Block(nn.Module):
    """Two layers of each kind and shape, as a model's decoder layers share shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.ups = nn.ModuleList(ColumnParallelLinear(512, 1536, bias=False) for _ in range(2))
        self.downs = nn.ModuleList(RowParallelLinear(1536, 512, bias=False) for _ in range(2))
        self.biased = ColumnParallelLinear(512, 256, bias=True)


def _tuned_block(rows: list[int]) -> _Block:
    from engine.kernels.lt_gemm import tune_linears

    block = _Block().to(device="cuda", dtype=torch.bfloat16)
    for p in block.parameters():
        p.data.normal_(0, 0.05)
    timings = tune_linears(block, rows, margin=-1.0)  # every shape and row count on cuBLASLt, whatever the timing
    assert sorted((t.m, t.n, t.k) for t in timings) == sorted((m, n, k) for m in rows for n, k in ((1536, 512),
                                                                                                   (512, 1536)))
    assert all(t.replaced and t.candidates >= 1 and 0 < t.lt_seconds < 1 and 0 < t.linear_seconds < 1
               for t in timings)
    return block


def _reference(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    return x.double() @ layer.weight.double().T


def _assert_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    # one rounding of the float32 sum to bf16, plus float32 accumulation order
    torch.testing.assert_close(out.double(), expected, rtol=2 ** -7, atol=2 ** -7 * expected.abs().max().item())


@gpu
def test_tuned_layers_compute_the_product_eagerly_and_in_a_cuda_graph() -> None:
    block = _tuned_block([16, 256])
    for layers in (block.ups, block.downs):
        tuned = layers[0].tuned_gemm
        assert tuned is not None and tuned is layers[1].tuned_gemm and sorted(tuned.by_rows) == [16, 256]
    assert block.biased.tuned_gemm is None  # a bias: F.linear's
    for rows in (16, 256):
        x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
        h = block.ups[0](x)
        assert h.shape == (rows, 1536) and h.dtype == torch.bfloat16
        _assert_close(h, _reference(x, block.ups[0]))
        _assert_close(block.downs[1](h), _reference(h, block.downs[1]))

    static_x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    block.downs[0](block.ups[1](static_x))  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = block.downs[0](block.ups[1](static_x))
    for _ in range(2):
        static_x.copy_(torch.randn_like(static_x))
        graph.replay()
        torch.cuda.synchronize()
        h = F.linear(static_x, block.ups[1].weight)
        _assert_close(static_out, _reference(h, block.downs[0]))


@gpu
def test_calls_the_tuning_did_not_cover_fall_back_to_f_linear() -> None:
    block = _tuned_block([16])
    layer = block.ups[0]
    tuned = layer.tuned_gemm
    assert tuned is not None
    x = torch.randn(40, 512, device="cuda", dtype=torch.bfloat16)
    assert tuned(x[:16], layer.weight) is not None
    assert tuned(x[:24], layer.weight) is None  # a row count not tuned
    shifted = torch.randn(16 * 512 + 8, device="cuda", dtype=torch.bfloat16)[8:].view(16, 512)  # 16 bytes in
    assert tuned(shifted, layer.weight) is None  # a pointer off the alignment the algorithms may assume
    assert tuned(x.t().contiguous().t()[:16], layer.weight) is None  # strided rows
    assert tuned(x[:16].float(), layer.weight.float()) is None  # another dtype
    assert tuned(x[:16], block.ups[1].weight[:768]) is None  # another weight shape
    assert tuned(x[:16, :256].contiguous(), layer.weight) is None  # an input of another width
    for rows in (16, 24):  # either way the layer's output is the product
        _assert_close(layer(x[1:1 + rows]), _reference(x[1:1 + rows], layer))
    _assert_close(layer(shifted), _reference(shifted, layer))
