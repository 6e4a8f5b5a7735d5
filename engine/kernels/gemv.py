"""A linear layer for one token (a batch-1 decode step): y = x @ W^T (+ bias), optionally with SiLU-and-mul of
x fused in front.

At one token a linear layer is a matrix-vector product bound by reading W. cuBLAS reaches the read bandwidth on
the wide gate_up projection but only ~75% on qkv and o_proj, and runs the down projection split-K with a
separate reduce kernel (bench/results/engine-speed-*.md, step profile). Here every program owns BLOCK_N whole
output rows and streams them along K, so no reduction crosses programs and enough programs run to keep every
SM's loads in flight. With `silu_mul_input`, x is [1, 2K] (gate then up) and each program computes
silu(gate) * up for its K chunk as it goes, rounded as engine/kernels/layers.silu_and_mul rounds: the separate
SiLU-and-mul launch disappears and the product's inputs are the same bf16 values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(x_ptr, residual_ptr, norm_weight_ptr, residual_out_ptr, w_ptr, bias_ptr, out_ptr,
                 N, K, stride_w, eps,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
                 NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    pid = tl.program_id(0)
    if NORM:
        # every program normalises the whole (tiny, L2-resident) input row itself, so no launch precedes it;
        # the first program also writes the residual stream out
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        store_limit = tl.where(pid == 0, K, 0)  # the columns this program writes to residual_out
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_mask = cols < K
            v = tl.load(x_ptr + cols, mask=col_mask, other=0.0)
            if HAS_RESIDUAL:
                v = (v.to(tl.float32) + tl.load(residual_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
                     ).to(v.dtype)
                tl.store(residual_out_ptr + cols, v, mask=cols < store_limit)
            v32 = v.to(tl.float32)
            squares += v32 * v32
        inv_rms = tl.rsqrt(tl.sum(squares, 0) / K + eps)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_mask = cols < K
        w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        x = tl.load(x_ptr + cols, mask=col_mask, other=0.0)
        if SILU_MUL:
            up = tl.load(x_ptr + K + cols, mask=col_mask, other=0.0)
            gate32 = x.to(tl.float32)
            activated = (gate32 / (1.0 + tl.exp(-gate32))).to(x.dtype).to(tl.float32)
            x = (activated * up.to(tl.float32)).to(up.dtype)
        if NORM:
            # rounded where engine/kernels/layers.rms_norm rounds
            if HAS_RESIDUAL:
                x = (x.to(tl.float32) + tl.load(residual_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
                     ).to(x.dtype)
            normed = (x.to(tl.float32) * inv_rms).to(x.dtype).to(tl.float32)
            scale = tl.load(norm_weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            x = (normed * scale).to(x.dtype)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


def default_config(num_rows: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps), from bench/h200/gemv_probe.py at the Llama-3.1-8B shapes on the H200
    (bench/results/engine-speed-*.md): long rows want more warps per row block; few rows want more rows per
    program, so fewer programs each stream more."""
    if k >= 8192:
        return 8, 512, 8
    if num_rows >= 16384:
        return 16, 256, 4
    if num_rows <= 4096:
        return 16, 1024, 8
    return 8, 512, 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul_input: bool = False,
         block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """x: [1, K] (or [1, 2K] gate then up with silu_mul_input); weight: [N, K] row-major (nn.Linear's);
    bias: [N] or None -> [1, N] in x's dtype. The block sizes default to `default_config`."""
    width = x.shape[-1] // 2 if silu_mul_input else x.shape[-1]
    if x.dim() != 2 or x.shape[0] != 1 or weight.shape[1] != width or (silu_mul_input and x.shape[-1] % 2):
        raise ValueError(f"gemv shapes disagree: x {tuple(x.shape)}, weight {tuple(weight.shape)}"
                         f"{' (x holds gate and up)' if silu_mul_input else ''}")
    out = torch.empty(1, weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(x, None, None, None, weight, bias, out, 0.0, silu_mul_input, (block_n, block_k, num_warps))
    return out


def rms_norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x + residual) @ weight^T (+ bias) for one token, in one launch: x, residual: [1, K] -> (the
    projection [1, N], x + residual). Without a residual (the first layer), (RMSNorm(x) @ weight^T, x)."""
    k = x.shape[-1]
    if (x.dim() != 2 or x.shape[0] != 1 or weight.shape[1] != k or norm_weight.shape != (k,)
            or (residual is not None and residual.shape != x.shape)):
        raise ValueError(f"rms_norm_gemv shapes disagree: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"norm weight {tuple(norm_weight.shape)}")
    out = torch.empty(1, weight.shape[0], dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else x
    _launch(x, residual, norm_weight, residual_out, weight, bias, out, eps, False, (None, None, None))
    return out, residual_out


def _launch(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None,
            residual_out: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
            eps: float, silu_mul_input: bool, config: tuple[int | None, int | None, int | None]) -> None:
    num_rows, k = weight.shape
    assert x.stride(-1) == 1 and weight.stride(1) == 1, "the K dims must be contiguous"
    block_n, block_k, num_warps = (given or default for given, default in zip(config, default_config(num_rows, k),
                                                                              strict=True))
    _gemv_kernel[(triton.cdiv(num_rows, block_n),)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x,
        residual_out if residual_out is not None else x, weight, bias if bias is not None else weight, out,
        num_rows, k, weight.stride(0), eps,
        BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, SILU_MUL=silu_mul_input,
        NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None, num_warps=num_warps,
    )
