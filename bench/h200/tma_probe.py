"""The decode step's GEMMs at M = 256 (Llama-3.1-8B shapes, bf16) through a Triton GEMM that loads its tiles with
Hopper's tensor memory accelerator (tensor descriptors), with optional split-K (fp32 atomics, then one cast),
against torch's F.linear. Answers whether Triton's TMA path beats cuBLAS where the pointer-load GEMM of
gemm_probe.py reached 200-440 TFLOP/s.

    python3 bench/h200/tma_probe.py [--batches 256] [--reps 60]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from gemm_probe import time_ms  # this folder: the script's own directory is on the path
from triton.tools.tensor_descriptor import TensorDescriptor

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K)
    (128, 128, 64, 8, 4, 1), (128, 256, 64, 8, 3, 1), (256, 128, 64, 8, 3, 1), (128, 128, 128, 8, 3, 1),
    (64, 128, 128, 4, 4, 1), (64, 256, 64, 4, 4, 1), (128, 64, 128, 4, 4, 1),
    (128, 128, 64, 8, 4, 2), (128, 128, 64, 8, 4, 4), (256, 128, 64, 8, 3, 2), (256, 128, 64, 8, 3, 4),
]


@triton.jit
def _tma_gemm(x_desc, w_desc, out_desc, out32_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    # M tiles fastest: the programs that share a W tile (the big operand) run side by side and hit L2 together
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid % num_m
    pid_n = (pid // num_m) % num_n
    split = pid // (num_m * num_n)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_first = split * per_split
    k_last = tl.minimum(k_first + per_split, k_tiles)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kt in range(k_first, k_last):
        a = x_desc.load([pid_m * BLOCK_M, kt * BLOCK_K])
        b = w_desc.load([pid_n * BLOCK_N, kt * BLOCK_K])
        acc = tl.dot(a, b.T, acc)
    if SPLIT_K == 1:
        out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(tl.bfloat16))
    else:
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.atomic_add(out32_ptr + rm[:, None] * N + rn[None, :], acc, sem="relaxed",
                      mask=(rm[:, None] < M) & (rn[None, :] < N))


def tma_linear(x: torch.Tensor, w: torch.Tensor, config) -> torch.Tensor:
    block_m, block_n, block_k, warps, stages, split = config
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=torch.bfloat16)
    out32 = torch.zeros(m, n, device=x.device, dtype=torch.float32) if split > 1 else out
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n) * split,)
    _tma_gemm[grid](TensorDescriptor.from_tensor(x, [block_m, block_k]),
                    TensorDescriptor.from_tensor(w, [block_n, block_k]),
                    TensorDescriptor.from_tensor(out, [block_m, block_n]), out32, m, n, k,
                    BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=warps,
                    num_stages=stages)
    return out32.to(torch.bfloat16) if split > 1 else out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="256")
    parser.add_argument("--reps", type=int, default=60)
    args = parser.parse_args()
    torch.manual_seed(0)
    for m in (int(b) for b in args.batches.split(",")):
        for name, (n, k) in SHAPES.items():
            copies = max(2, -(-600 * 2**20 // (n * k * 2)))
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            flop = 2 * m * n * k
            results = {"F.linear": time_ms(lambda w, x=x: torch.nn.functional.linear(x, w), weights, args.reps)}
            reference = torch.nn.functional.linear(x, weights[0]).float()
            for config in CONFIGS:
                try:
                    err = (tma_linear(x, weights[0], config).float() - reference).abs().max().item()
                    t = time_ms(lambda w, c=config, x=x: tma_linear(x, w, c), weights, args.reps)
                except Exception as e:  # noqa: BLE001 - a config that does not fit is reported, not fatal
                    print(f"  {config}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                results[f"tma{config} err={err:.1e}"] = t
            print(f"M={m} {name} N={n} K={k}: " + ", ".join(
                f"{key} {t * 1e3:.0f} us {flop / t / 1e9:.0f} TF" for key, t in results.items()), flush=True)
            del weights


if __name__ == "__main__":
    main()
