"""engine/kernels/hopper_mlp.py's fused gate_up + SiLU-and-mul against what it replaces (F.linear, i.e. cuBLAS,
then engine/kernels/layers.silu_and_mul), Llama-3.1-8B's MLP shape, at decode and prompt-step row counts, each in
a CUDA graph with the weights rotating over copies larger than L2. Answers at which batch sizes the engine should
take the fused kernel (it ships for 64-512 rows, where this measured it to win on an H100).

    python3 bench/h200/hopper_mlp_probe.py [--rows 64,128,256,512,1024,2048,4096,8192]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.h200.graph_timing import graph_time_ms  # noqa: E402
from engine.kernels import hopper_mlp  # noqa: E402
from engine.kernels.layers import silu_and_mul  # noqa: E402

HIDDEN, INTER = 4096, 14336


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="64,128,256,512,1024,2048,4096,8192")
    args = parser.parse_args()
    hopper_mlp.MIN_ROWS, hopper_mlp.MAX_ROWS = 1, 1 << 20  # every row count, to find where it wins
    print(torch.cuda.get_device_name(), "kernel usable:", hopper_mlp.device_supported(torch.device("cuda")))
    torch.manual_seed(0)
    weights = [(torch.randn(2 * INTER, HIDDEN, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(3)]
    print("| rows | cuBLAS + SiLU-and-mul us | fused us | speed-up | TFLOP/s fused | outputs equal |")
    print("|---|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, HIDDEN, device="cuda").to(torch.bfloat16)
        reps = max(5, min(100, 20000 // rows))
        unfused = 1e3 * graph_time_ms(lambda w, x=x: silu_and_mul(F.linear(x, w)), weights, reps)
        fused = 1e3 * graph_time_ms(lambda w, x=x: hopper_mlp.gate_up_silu(x, w), weights, reps)
        equal = (hopper_mlp.gate_up_silu(x, weights[0]) == silu_and_mul(F.linear(x, weights[0]))).float().mean()
        flop = 2 * rows * 2 * INTER * HIDDEN
        print(f"| {rows} | {unfused:.1f} | {fused:.1f} | {unfused / fused:.3f} | {flop / fused / 1e6:.0f} | "
              f"{equal.item():.4f} |", flush=True)


if __name__ == "__main__":
    main()
