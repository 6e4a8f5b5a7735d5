"""A/B of a bf16 decoder's linear layers on the CPU: oneDNN's packed weights vs the AVX512-BF16 tile kernel
(engine/layers/cpu_linear.cpp), in one process, alternating, over SmolLM2-135M's shapes (30 layers of q/k/v, o,
gate/up and down, plus the lm_head; every layer its own weights, so they stream from memory as in a step):

    python bench/cpu_linear_ab.py [--rows 1,8,16,64,256,2048]

Prints per shape and per row count the time of one call each way and the step's total (30 layers + lm_head).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
LAYERS = 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,16,64,256,2048")
    args = parser.parse_args()

    from engine.layers.cpu_kernels import has_bf16_dot, kernel

    module = kernel()
    if module is None or not has_bf16_dot():
        sys.exit("this CPU has no AVX512-BF16 (or the kernels did not build): nothing to compare")
    torch.manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        totals = {"oneDNN": 0.0, "tiles": 0.0}
        for name, (out_features, in_features) in SHAPES.items():
            count = 1 if name == "lm_head" else LAYERS
            weights = [torch.randn(out_features, in_features).bfloat16() for _ in range(count)]
            onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in weights]
            tiles = [module.pack_bf16_linear_weight(w) for w in weights]
            x = torch.randn(rows, in_features).bfloat16()
            best = {"oneDNN": float("inf"), "tiles": float("inf")}
            for _ in range(3 if rows <= 256 else 1):
                start = time.perf_counter()
                for packed in onednn:
                    torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
                best["oneDNN"] = min(best["oneDNN"], (time.perf_counter() - start) / count)
                start = time.perf_counter()
                for tile in tiles:
                    module.bf16_linear(x, tile, out_features, None)
                best["tiles"] = min(best["tiles"], (time.perf_counter() - start) / count)
            for side in best:
                totals[side] += best[side] * count
            print(f"{rows:5d} rows {name:8s} oneDNN {best['oneDNN'] * 1e6:9.1f} us  tiles {best['tiles'] * 1e6:9.1f} us"
                  f"  ({best['oneDNN'] / best['tiles']:.2f}x)")
        print(f"{rows:5d} rows, the step's linears: oneDNN {totals['oneDNN'] * 1e3:.2f} ms, tiles "
              f"{totals['tiles'] * 1e3:.2f} ms ({totals['oneDNN'] / totals['tiles']:.2f}x)")


if __name__ == "__main__":
    main()
