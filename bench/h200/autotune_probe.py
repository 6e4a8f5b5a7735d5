"""The decode step's GEMMs at M = 256 (Llama-3.1-8B shapes, bf16) against what else torch ships for Hopper:
torch._grouped_mm with one group (a CUTLASS sm90 kernel, not cuBLAS) and Inductor's max-autotune GEMM templates
(Triton, persistent TMA). Answers whether any of them beats F.linear (cuBLAS) where cuBLAS runs at ~600 TFLOP/s.

    python3 bench/h200/autotune_probe.py [--batches 256] [--shapes gate_up,down] [--exhaustive]

Weights rotate over enough copies to exceed L2, as in a step where the other layers evict them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.h200.graph_timing import graph_time_ms  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="256")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--exhaustive", action="store_true")
    args = parser.parse_args()
    import torch._inductor.config as inductor_config

    inductor_config.max_autotune_gemm_backends = "ATEN,TRITON"
    inductor_config.triton.enable_persistent_tma_matmul = True
    if args.exhaustive:
        inductor_config.max_autotune_gemm_search_space = "EXHAUSTIVE"
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    torch.manual_seed(0)
    for m in (int(b) for b in args.batches.split(",")):
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            copies = max(2, -(-400 * 2**20 // (n * k * 2)))
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            flop = 2 * m * n * k
            reference = F.linear(x, weights[0]).float()
            results: dict[str, float] = {}
            results["F.linear"] = graph_time_ms(lambda w, x=x: F.linear(x, w), weights, args.reps)
            try:
                grouped = lambda w, x=x: torch._grouped_mm(x.unsqueeze(0), w.t().unsqueeze(0))[0]  # noqa: E731
                err = (grouped(weights[0]).float() - reference).abs().max().item()
                results[f"grouped_mm err={err:.1e}"] = graph_time_ms(grouped, weights, args.reps)
            except Exception as e:  # noqa: BLE001 - an op this torch lacks is reported, not fatal
                print(f"  grouped_mm: {type(e).__name__}: {str(e)[:200]}")
            try:
                torch._dynamo.reset()
                compiled = torch.compile(lambda a, b: F.linear(a, b), mode="max-autotune-no-cudagraphs",
                                         dynamic=False)
                t0 = time.perf_counter()
                err = (compiled(x, weights[0]).float() - reference).abs().max().item()
                print(f"  inductor autotune took {time.perf_counter() - t0:.0f} s", flush=True)
                results[f"inductor err={err:.1e}"] = graph_time_ms(lambda w, x=x, fn=compiled: fn(x, w), weights,
                                                                   args.reps)
            except Exception as e:  # noqa: BLE001
                print(f"  inductor: {type(e).__name__}: {str(e)[:300]}")
            print(f"M={m} {name} N={n} K={k}: " + ", ".join(
                f"{key} {t * 1e3:.1f} us {flop / t / 1e9:.0f} TF" for key, t in results.items()), flush=True)
            del weights


if __name__ == "__main__":
    main()
