"""The decode step's GEMMs at batch M (Llama-3.1-8B shapes, bf16): cuBLAS as torch calls it, cuBLASLt preferred,
and a plain Triton GEMM over a few tile configs. Answers whether anything beats torch's default at M = 256,
where the step profile found qkv at ~586 and o_proj at ~537 TFLOP/s (too few output tiles for 132 SMs).

    python3 bench/h200/gemm_probe.py [--batches 256] [--reps 100]

Weights rotate over enough copies to exceed L2 (as in a step, where the other layers evict them).
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
    (64, 128, 64, 4, 4), (64, 128, 128, 4, 3), (64, 256, 64, 8, 4), (64, 64, 128, 4, 4),
    (128, 128, 64, 8, 4), (128, 128, 128, 8, 3), (128, 256, 64, 8, 3), (128, 64, 128, 4, 4),
]


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    # N-tiles outermost so that the programs sharing a W tile run together (W is the big operand)
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m
    pid_n = pid // num_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None] * K + rk[None, :]
    w_ptrs = w_ptr + rn[None, :] * K + rk[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=rm[:, None] < M, other=0.0)
        w = tl.load(w_ptrs, mask=rn[None, :] < N, other=0.0)
        acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def triton_linear(x: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int, int, int]) -> torch.Tensor:
    block_m, block_n, block_k, warps, stages = config
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _gemm_kernel[grid](x, w, out, m, n, k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                       num_warps=warps, num_stages=stages)
    return out


def time_ms(fn, weights: list[torch.Tensor], reps: int) -> float:
    for w in weights[:2]:
        fn(w)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(reps):
        fn(weights[i % len(weights)])
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="256")
    parser.add_argument("--reps", type=int, default=100)
    args = parser.parse_args()
    torch.manual_seed(0)
    for m in (int(b) for b in args.batches.split(",")):
        for name, (n, k) in SHAPES.items():
            copies = max(2, -(-400 * 2**20 // (n * k * 2)))  # > 400 MiB of weights: L2 (50 MB) cannot hold them
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            flop = 2 * m * n * k
            results = {}
            torch.backends.cuda.preferred_blas_library("cublas")
            results["cublas"] = time_ms(lambda w, x=x: torch.nn.functional.linear(x, w), weights, args.reps)
            torch.backends.cuda.preferred_blas_library("cublaslt")
            results["cublaslt"] = time_ms(lambda w, x=x: torch.nn.functional.linear(x, w), weights, args.reps)
            torch.backends.cuda.preferred_blas_library("cublas")
            reference = torch.nn.functional.linear(x, weights[0]).float()
            for config in CONFIGS:
                try:
                    err = (triton_linear(x, weights[0], config).float() - reference).abs().max().item()
                    t = time_ms(lambda w, c=config, x=x: triton_linear(x, w, c), weights, args.reps)
                except Exception as e:  # noqa: BLE001 - a config that does not fit is reported, not fatal
                    print(f"  {config}: {type(e).__name__}")
                    continue
                results[f"triton{config} err={err:.1e}"] = t
            best = min(results, key=results.get)
            print(f"M={m} {name} N={n} K={k}: " + ", ".join(
                f"{key} {t * 1e3:.0f} us {flop / t / 1e9:.0f} TF" for key, t in results.items()))
            print(f"  best: {best} ({flop / results[best] / 1e9:.0f} TFLOP/s; cublas "
                  f"{flop / results['cublas'] / 1e9:.0f})", flush=True)
            del weights


if __name__ == "__main__":
    main()
