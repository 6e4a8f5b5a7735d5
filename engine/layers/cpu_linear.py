"""Half-precision linear layers on a CPU without bf16/fp16 dot-product instructions (AVX2 hosts).

There torch's bf16 GEMM converts inside its inner loop and runs 4-6x slower than float32's (measured on the
bench box, [64, 576] x [576, 960]: 12 ms float32, 68 ms bfloat16, one thread). Widening the weights to float32
once at load, and each input at the call, gives the same arithmetic a bf16 GEMM does (bf16 values are exact in
float32, products are accumulated in float32, the output is rounded to the model's dtype), in float32's time.
The weights take twice the memory: a CPU model is small next to the host's.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from engine.layers.linear import ColumnParallelLinear, dense_linear

HALF_TYPES = (torch.bfloat16, torch.float16)


@functools.cache
def has_half_dot_product() -> bool:
    """Whether the CPU multiplies bf16 natively (AVX512-BF16 or AMX), where torch's bf16 GEMM is fast."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


class WidenedLinear(nn.Module):
    """A linear layer whose half-precision weights are kept in float32; input and output keep the model's
    dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.out_dtype = linear.weight.dtype
        self.weight = nn.Parameter(linear.weight.detach().float(), requires_grad=False)
        self.bias = (None if linear.bias is None
                     else nn.Parameter(linear.bias.detach().float(), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x.float(), self.weight, self.bias).to(self.out_dtype)


def widen_half_linears(model: nn.Module) -> int:
    """Replaces every half-precision nn.Linear of a CPU model by a WidenedLinear, unless the CPU has native
    half dot products. Returns how many were replaced. Tied weights are widened as copies: the embedding
    keeps its own half-precision table."""
    if has_half_dot_product():
        return 0
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            # only layers whose forward is a plain product: a row-parallel layer's forward also sums over the
            # tensor-parallel ranks, which a WidenedLinear would drop
            plain = type(child).forward in (nn.Linear.forward, ColumnParallelLinear.forward)
            if (isinstance(child, nn.Linear) and plain
                    and child.weight.dtype in HALF_TYPES and child.weight.device.type == "cpu"):
                setattr(parent, name, WidenedLinear(child))
                replaced += 1
    return replaced
