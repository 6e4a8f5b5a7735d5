"""A GPU node's profile (benchmark/profile.py) from figures measured on one H200, for the planner's projections
at sizes no box here has: the points are the recorded measurements, the coefficients benchmark.profile.fit's.

Sources (Llama-3.1-8B's shape, random bf16 weights, CUDA graphs, one H200):
- decode steps, context 1024, batch 1 / 8 / 64: 5.37 / 5.83 / 9.13 ms (engine.step() wall time,
  bench/results/decode-step-2026-12-02.md);
- TTFT of one request alone, colocated, 1024 / 8192 prompt tokens: 25.7 / 223.5 ms median (through the proxy's
  gRPC path), and the handoff (P/D minus colocated first -> second token): 4.2 ms at 1024, 9.8 ms at 8192
  (bench/results/gpu-cluster-2026-12-03.md, run 4's latency table);
(The serving table's TTFT under load is not used: its requests queue behind decode steps as they arrive, not a
batch sent at once, which is what a prefill point is.)
KV blocks: 16-token blocks of 2 MiB (32 layers x 8 KV heads x 128 x K and V x bf16); a node given 0.9 of the
H200's 139 GiB, less 16.1 GB of weights and ~3 GB of activations and graphs, holds ~52,000 (an estimate: the
planner only needs it as the bound on a decode node's concurrency, which the ITL SLO reaches first).

    .venv/bin/python bench/gpu_profile_from_figures.py --out bench/results/profile-h200-llama8b-shape.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmark.profile import DecodePoint, HandoffPoint, NodeSpec, Points, PrefillPoint, Profile, fit, fit_errors  # noqa: E402

BLOCK_BYTES = 32 * 8 * 128 * 2 * 2 * 16
NODE_BYTES = 0.9 * 139 * 2**30 - 16.1e9 - 3e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    node = NodeSpec(model="llama-3.1-8b-shape", dtype="bfloat16", device="cuda", threads=0,
                    max_num_batched_tokens=2048, max_num_seqs=128, block_size=16,
                    num_kv_blocks=int(NODE_BYTES // BLOCK_BYTES))
    points = Points(
        prefill=(PrefillPoint(1024, 1, 0.0257), PrefillPoint(8192, 1, 0.2235)),
        decode=(DecodePoint(1, 1024, 0.00537), DecodePoint(8, 1024, 0.00583), DecodePoint(64, 1024, 0.00913)),
        handoff=(HandoffPoint(1024, 0.0042), HandoffPoint(8192, 0.0098)),
    )
    step, request_s, h0, h1 = fit(node, points)
    profile = Profile(node, step, request_s, h0, h1, points, hardware="NVIDIA H200 (recorded figures)", cores=0,
                      command=" ".join(sys.argv))
    for label, measured, fitted in fit_errors(profile):
        print(f"{label}: measured {measured * 1e3:.2f} ms, fitted {fitted * 1e3:.2f} ms "
              f"({(fitted - measured) / measured:+.0%})")
    profile.save(args.out)
    print(f"wrote {args.out}: {step}, request {request_s * 1e3:.2f} ms, handoff {h0 * 1e3:.2f} ms + "
          f"{h1 * 1e6:.3f} us/token")


if __name__ == "__main__":
    main()
