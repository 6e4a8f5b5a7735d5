"""Small layers whose math must equal transformers' in float32: RMSNorm, SiLU-gated MLP activation, RoPE."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import RopeConfig
from engine.layers import cpu_kernels
from engine.layers.linear import RowParallelLinear


class RMSNorm(nn.Module):
    """RMSNorm; with `fused`, a Triton kernel (GPU) instead of the torch ops; on the CPU in 16 bits, the C++ op
    (engine/layers/cpu_kernels.py)."""

    def __init__(self, size: int, eps: float, fused: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from engine.kernels.layers import rms_norm

            return rms_norm(x, self.weight, self.eps)
        if cpu_kernels.layer_ops_serve(x, float32=False):
            return cpu_kernels.rms_norm(x, self.weight, self.eps)[0]
        # As transformers: normalise in float32, cast back, then scale (F.rms_norm does the float32 part
        # in one pass, bit-equal to mean/rsqrt in float32 and 3x faster on CPU).
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual), x + residual): the residual add fused into the norm where kernels are on."""
        if self.fused:
            from engine.kernels.layers import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if cpu_kernels.layer_ops_serve(x, float32=False):
            return cpu_kernels.rms_norm(x, self.weight, self.eps, residual)
        summed = x + residual
        return self.forward(summed), summed


def linear(layer: nn.Linear, x: torch.Tensor, fused: bool, silu_mul_input: bool = False) -> torch.Tensor:
    """layer(x); for one token (a batch-1 decode step) with the GPU kernels on, the GEMV kernel of
    engine/kernels/gemv.py, which reads the weights closer to the memory bandwidth than cuBLAS does at these
    shapes. With silu_mul_input, x is [1, 2I] (gate then up) and SiLU-and-mul runs inside the same kernel."""
    if fused and x.shape[0] == 1:
        from engine.kernels.gemv import gemv  # needs triton: imported where it runs

        out = gemv(x, layer.weight, layer.bias, silu_mul_input=silu_mul_input)
        # a row-parallel layer's partial products are summed over the ranks, as its own forward does
        return layer.parallel.all_reduce(out) if isinstance(layer, RowParallelLinear) else out
    assert not silu_mul_input, "SiLU-and-mul fuses into a linear layer only for one token with the GPU kernels"
    return layer(x)


def silu_and_mul(gate_up: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """gate_up: [T, 2*I] (gate then up) -> [T, I]."""
    if fused:
        from engine.kernels.layers import silu_and_mul as fused_silu_and_mul

        return fused_silu_and_mul(gate_up)
    if cpu_kernels.layer_ops_serve(gate_up, float32=False):
        return cpu_kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves) with a precomputed cos/sin table per position."""

    cos_sin: torch.Tensor

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused
        inv_freq = rope_inv_freq(rope, head_dim)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # cos_sin: [max_positions, head_dim] = cos of the half-dims, then sin
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)
        self.head_dim = head_dim

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T]; q: [T, Hq, D]; k: [T, Hkv, D]."""
        if self.fused:
            from engine.kernels.layers import rotary_embedding

            return rotary_embedding(positions, q, k, self.cos_sin)
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)  # [T, D/2] each
        cos = cos[:, None, :]
        sin = sin[:, None, :]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    x1, x2 = x.chunk(2, dim=-1)
    # transformers casts cos/sin to the activations' dtype before multiplying
    cos = cos.to(dtype)
    sin = sin.to(dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
