"""Fused small layers: RMSNorm (optionally with the residual add), neox RoPE, SiLU-and-multiply.

Each rounds to the activations' dtype where transformers' eager code does, so in bf16 the results match
engine/layers/basic.py up to float32 reduction order, not just up to bf16 noise.
"""

from __future__ import annotations

from typing import overload

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_residual, stride_out, stride_residual_out, hidden_size, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # the residual stream is kept in the activations' dtype, as transformers adds it
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
             .to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, 0) / hidden_size + eps)
    normed = (x32 * inv_rms).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


@overload
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: None = None) -> torch.Tensor: ...


@overload
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]: ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [..., H] -> RMSNorm(x) in x's dtype. With residual: (RMSNorm(x + residual), x + residual)."""
    hidden_size = x.shape[-1]
    if weight.shape != (hidden_size,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"rms_norm shapes disagree: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    rows = x.reshape(-1, hidden_size)
    out = torch.empty_like(rows)
    residual_rows = rows if residual is None else residual.reshape(-1, hidden_size)
    residual_out = torch.empty_like(rows) if residual is not None else out
    if rows.shape[0]:
        block = triton.next_power_of_2(hidden_size)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, residual_rows, weight, out, residual_out,
            rows.stride(0), residual_rows.stride(0), out.stride(0), residual_out.stride(0), hidden_size, eps,
            BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=min(16, max(1, block // 256)),
        )
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), residual_out.view(x.shape)


@triton.jit
def rotated_halves(x_ptr, token, stride_token, stride_head, cos, sin, num_heads, HEADS_PAD: tl.constexpr,
                   HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """One token's heads [HEADS_PAD, HALF_PAD] x2 rotated (neox halves), in x's dtype; also engine/kernels/kv_store.py's
    fused RoPE + store."""
    heads = tl.arange(0, HEADS_PAD)[:, None]
    cols = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < num_heads) & (cols < HALF)
    src = x_ptr + token * stride_token + heads * stride_head + cols
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    # round each product and sum to the activations' dtype, as eager torch does
    c = cos.to(dtype).to(tl.float32)
    s = sin.to(dtype).to(tl.float32)
    a1 = (x1.to(tl.float32) * c).to(dtype).to(tl.float32)
    b1 = (x2.to(tl.float32) * s).to(dtype).to(tl.float32)
    a2 = (x2.to(tl.float32) * c).to(dtype).to(tl.float32)
    b2 = (x1.to(tl.float32) * s).to(dtype).to(tl.float32)
    return (a1 - b1).to(dtype), (a2 + b2).to(dtype)


@triton.jit
def token_cos_sin(positions_ptr, cos_sin_ptr, stride_cos_sin, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """This program's token and the cos and sin rows [1, HALF_PAD] of its position (float32); also the fused RoPE +
    store's (engine/kernels/kv_store.py)."""
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, HALF_PAD)[None, :]
    cos = tl.load(cos_sin_ptr + pos * stride_cos_sin + cols, mask=cols < HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cos_sin + HALF + cols, mask=cols < HALF, other=0.0)
    return token, cos, sin


@triton.jit
def rotate_heads(x_ptr, out_ptr, token, stride_token, stride_head, stride_out_token, stride_out_head,
                  cos, sin, num_heads, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    first, second = rotated_halves(x_ptr, token, stride_token, stride_head, cos, sin, num_heads, HEADS_PAD, HALF,
                                   HALF_PAD)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    cols = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < num_heads) & (cols < HALF)
    dst = out_ptr + token * stride_out_token + heads * stride_out_head + cols
    tl.store(dst, first, mask=mask)
    tl.store(dst + HALF, second, mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cos_sin_ptr, q_out_ptr, k_out_ptr,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head,
    stride_qo_token, stride_qo_head, stride_ko_token, stride_ko_head, stride_cos_sin,
    num_q_heads, num_k_heads,
    Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    token, cos, sin = token_cos_sin(positions_ptr, cos_sin_ptr, stride_cos_sin, HALF, HALF_PAD)
    rotate_heads(q_ptr, q_out_ptr, token, stride_q_token, stride_q_head, stride_qo_token, stride_qo_head,
                  cos, sin, num_q_heads, Q_HEADS_PAD, HALF, HALF_PAD)
    rotate_heads(k_ptr, k_out_ptr, token, stride_k_token, stride_k_head, stride_ko_token, stride_ko_head,
                  cos, sin, num_k_heads, K_HEADS_PAD, HALF, HALF_PAD)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox RoPE. positions: [T]; q: [T, Hq, D]; k: [T, Hkv, D] (last dim contiguous, any other strides);
    cos_sin_cache: [max_pos, D] float32 = cat(cos, sin) of the half-dims. Returns new (q, k)."""
    num_tokens, num_q_heads, head_dim = q.shape
    if (k.shape[0], k.shape[2]) != (num_tokens, head_dim) or cos_sin_cache.shape[1] != head_dim or head_dim % 2:
        raise ValueError(f"rotary shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"cos_sin_cache {tuple(cos_sin_cache.shape)}")
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos_sin_cache.stride(1) == 1, "last dims must be contiguous"
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            positions, q, k, cos_sin_cache, q_out, k_out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0),
            num_q_heads, k.shape[1],
            Q_HEADS_PAD=triton.next_power_of_2(num_q_heads), K_HEADS_PAD=triton.next_power_of_2(k.shape[1]),
            HALF=half, HALF_PAD=triton.next_power_of_2(half), num_warps=4,
        )
    return q_out, k_out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, size, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + size + cols, mask=mask, other=0.0)
    gate32 = gate.to(tl.float32)
    activated = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (activated * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2*I] (gate then up, last dim contiguous) -> silu(gate) * up: [T, I]."""
    num_tokens, width = x.shape
    if width % 2:
        raise ValueError(f"silu_and_mul needs an even last dim, got {tuple(x.shape)}")
    assert x.stride(1) == 1, "last dim must be contiguous"
    size = width // 2
    out = torch.empty(num_tokens, size, dtype=x.dtype, device=x.device)
    if num_tokens:
        block = min(1024, triton.next_power_of_2(size))
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(size, block))](
            x, out, x.stride(0), out.stride(0), size, BLOCK=block, num_warps=4,
        )
    return out
