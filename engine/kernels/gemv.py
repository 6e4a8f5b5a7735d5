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
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, N, K, stride_w,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
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
    if num_rows <= 4096:
        return 16, 1024, 8
    return 8, 512, 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul_input: bool = False,
         block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """x: [1, K] (or [1, 2K] gate then up with silu_mul_input); weight: [N, K] row-major (nn.Linear's);
    bias: [N] or None -> [1, N] in x's dtype. The block sizes default to `default_config`."""
    width = x.shape[-1] // 2 if silu_mul_input else x.shape[-1]
    num_rows, k = weight.shape
    if x.dim() != 2 or x.shape[0] != 1 or k != width or (silu_mul_input and x.shape[-1] % 2):
        raise ValueError(f"gemv shapes disagree: x {tuple(x.shape)}, weight {tuple(weight.shape)}"
                         f"{' (x holds gate and up)' if silu_mul_input else ''}")
    assert x.stride(-1) == 1 and weight.stride(1) == 1, "the K dims must be contiguous"
    default_n, default_k, default_warps = default_config(num_rows, k)
    block_n, block_k, num_warps = block_n or default_n, block_k or default_k, num_warps or default_warps
    out = torch.empty(1, num_rows, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(num_rows, block_n),)](
        x, weight, bias if bias is not None else weight, out, num_rows, k, weight.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, SILU_MUL=silu_mul_input, num_warps=num_warps,
    )
    return out
