"""CPU linear layers with weights packed once at load: bf16 tiles for our own kernel on CPUs with AVX512-BF16, else
oneDNN's blocked layout.

torch's default CPU product (MKL for float32, a converting loop for bf16 on hosts without bf16 instructions) runs a
decode step's few rows far below the memory bandwidth. oneDNN's inner-product primitive on a weight reordered once
into its blocked layout does better (bf16 values widened in registers, products summed in float32, the output
rounded to bf16: a bf16 GEMM's arithmetic): SmolLM2-135M's linears of one decode step at 8 rows took 45.5 ms
(float32, MKL) and 24.5 ms packed; in bf16 13.9 ms (bench/results/engine-speed-2026-12-04.md, "CPU"). But at 8
rows it read bf16 weights at ~20 GB/s where the box streams 30-35, so on CPUs with AVX512-BF16 a bf16 layer runs
engine/layers/cpu_linear.cpp instead: the same arithmetic (pairs of bf16 products summed into float32 by
VDPBF16PS, the output rounded to bf16), 1.8x oneDNN's speed at 8 rows and equal to it at a 2048-token prefill,
where both run at the cores' peak (bench/results/engine-speed-2026-12-04-evening.md).

float16 has no oneDNN path without AVX512-FP16 or AVX-NE-CONVERT, nor bf16 without AVX512BW/VL/DQ or
AVX-NE-CONVERT: such a layer is packed as float32 (the weights widened once: half values are exact in float32) and
its input widened at the call, which is the arithmetic of a half GEMM that accumulates in float32.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from engine.layers import cpu_kernels
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.parallel.context import SINGLE_RANK, ParallelContext

HALF_TYPES = (torch.bfloat16, torch.float16)


@functools.cache
def has_half_dot_product() -> bool:
    """Whether the CPU multiplies bf16 natively (AVX512-BF16 or AMX), where torch's own bf16 kernels are fast."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


# the row count oneDNN picks its weight layout for: a decode step's; the packed weight serves every row count
# (a 2048-token prefill ran 0.73-0.86x F.linear's time with this layout)
_PACKED_FOR_ROWS = 8


def packed_compute_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a packed CPU layer of `dtype` computes in, or None when it is not packed. bf16 stays bf16 where
    oneDNN multiplies it on this CPU (AVX512BW/VL/DQ or AVX-NE-CONVERT; elsewhere its reorder raises, seen on an
    AVX2-only EPYC) and is widened to float32 otherwise, as float16 always is: bf16 and fp16 values are exact in
    float32, so either way it is the arithmetic of a half GEMM that accumulates in float32."""
    if dtype == torch.float32:
        return dtype
    if dtype == torch.bfloat16:
        return dtype if _onednn_multiplies_bf16() else torch.float32
    if dtype == torch.float16:
        return torch.float32
    return None


@functools.cache
def _onednn_multiplies_bf16() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """A linear layer (plain, column- or row-parallel) whose weight is held packed: as bf16 tiles for
    engine/layers/cpu_linear.cpp (a bf16 layer whose input size is even, on a CPU with AVX512-BF16), else in
    oneDNN's layout. Input and output keep the model's dtype. A row-parallel layer's partial products are still
    summed over the ranks."""

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.out_dtype = linear.weight.dtype
        self.compute_dtype = compute_dtype
        self.parallel: ParallelContext = (linear.parallel if isinstance(linear, RowParallelLinear)
                                          else SINGLE_RANK)
        weight = linear.weight.detach()
        self.tiles: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None
        if compute_dtype == torch.bfloat16 and weight.shape[1] % 2 == 0 and cpu_kernels.has_bf16_dot():
            module = cpu_kernels.kernel()
            assert module is not None, "has_bf16_dot() says it is built"
            self.tiles = module.pack_bf16_linear_weight(weight.to(torch.bfloat16))
            bias_dtype = torch.float32  # added to the float32 sums before they are rounded, as oneDNN does
        else:
            # an opaque oneDNN tensor: not a parameter (state_dict and .to() cannot hold it), and not needed there:
            # packing happens after the checkpoint is loaded, on the CPU the layer stays on
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(compute_dtype), _PACKED_FOR_ROWS)
            bias_dtype = compute_dtype
        self.bias = (None if linear.bias is None
                     else nn.Parameter(linear.bias.detach().to(bias_dtype), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiles is not None:
            module = cpu_kernels.kernel()
            assert module is not None, "the tiles were packed by the built kernels"
            rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
            out = module.bf16_linear(rows if rows.stride(-1) == 1 else rows.contiguous(), self.tiles,
                                     self.out_features, self.bias)
            out = out.view(*x.shape[:-1], self.out_features)
        else:
            out = torch.ops.mkldnn._linear_pointwise(x.to(self.compute_dtype), self.packed, self.bias, "none", [], "")
        return self.parallel.all_reduce(out.to(self.out_dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.out_dtype}"


def pack_cpu_linears(model: nn.Module) -> int:
    """Replaces every CPU linear layer of the model (nn.Linear, column- and row-parallel) by a PackedLinear, where
    this torch has oneDNN. Returns how many were replaced. A tied lm_head is packed as a copy: the embedding
    keeps its own table."""
    if not torch.backends.mkldnn.is_available():
        return 0
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            # only layers whose forward is the plain product (a row-parallel one's plus its sum over the ranks)
            plain = type(child).forward in (nn.Linear.forward, ColumnParallelLinear.forward,
                                            RowParallelLinear.forward)
            if not (plain and isinstance(child, nn.Linear) and child.weight.device.type == "cpu"):
                continue
            compute_dtype = packed_compute_dtype(child.weight.dtype)
            if compute_dtype is not None:
                setattr(parent, name, PackedLinear(child, compute_dtype))
                replaced += 1
    return replaced
