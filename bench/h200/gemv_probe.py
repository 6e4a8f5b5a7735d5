"""Batch-1 linear layers of the Llama-3.1-8B shape: cuBLAS (F.linear) against engine/kernels/gemv.py's configs.

    python3 bench/h200/gemv_probe.py

Each variant runs over 32 distinct weight matrices (one per layer, as a decode step does, so L2 never holds
them) inside one CUDA graph; the figure is device time per matrix and the read bandwidth it reaches. The down
projection is also timed with SiLU-and-mul fused in front against silu_and_mul + F.linear. Every config's
output is checked against float32 math.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from engine.kernels.gemv import gemv  # noqa: E402
from engine.kernels.layers import silu_and_mul  # noqa: E402

LAYERS = 32
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def graph_time(fn, reps: int = 20) -> float:
    """Seconds per call of fn (which runs LAYERS matmuls), timed as graph replays."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def main() -> None:
    torch.manual_seed(0)
    device = torch.device("cuda")
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        silu = name == "down"
        x = torch.randn(1, 2 * k if silu else k, device=device, dtype=torch.bfloat16)
        act = silu_and_mul(x) if silu else x
        ref = (act.float() @ weights[0].float().T)
        nbytes = n * k * 2
        base = graph_time(lambda a=act, ws=weights: [F.linear(a, w) for w in ws]) / LAYERS
        print(f"{name} [{n}x{k}] cuBLAS F.linear: {base * 1e6:.1f} us  {nbytes / base / 1e12:.2f} TB/s", flush=True)
        if silu:
            fused_base = graph_time(lambda a=x, ws=weights: [F.linear(silu_and_mul(a), w) for w in ws]) / LAYERS
            print(f"  silu_and_mul + F.linear: {fused_base * 1e6:.1f} us", flush=True)
        results = []
        for block_n, block_k, warps in itertools.product((4, 8, 16), (256, 512, 1024), (4, 8)):
            if block_n * block_k > 16384:
                continue
            try:
                out = gemv(x, weights[0], silu_mul_input=silu, block_n=block_n, block_k=block_k, num_warps=warps)
                err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                t = graph_time(lambda a=x, ws=weights, s=silu, bn=block_n, bk=block_k, nw=warps: [
                    gemv(a, w, silu_mul_input=s, block_n=bn, block_k=bk, num_warps=nw) for w in ws]) / LAYERS
            except Exception as e:  # a config that does not compile is skipped, not fatal
                print(f"  n{block_n} k{block_k} w{warps}: {type(e).__name__}: {e}"[:200], flush=True)
                continue
            results.append((t, block_n, block_k, warps, err))
        results.sort()
        for t, block_n, block_k, warps, err in results[:6]:
            print(f"  gemv n{block_n} k{block_k} w{warps}: {t * 1e6:.1f} us  {nbytes / t / 1e12:.2f} TB/s  "
                  f"rel err {err:.1e}", flush=True)
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
