"""Decode attention at short contexts: how finely to split the context (graph-timed, Llama-3.1-8B shapes).

    python3 bench/h200/decode_sweep.py            # short contexts, small batches
    python3 bench/h200/decode_sweep.py --large    # the offline run's decode shapes (batch 256, 1-2k context)

At batch 1 and 1k context a layer's decode attention reads 4 MiB, ~1 us at full bandwidth, but the engine's
profile shows ~9.5 us + a 1.7 us merge: latency, not bandwidth. Times the default against finer minimum
partitions and fixed partition sizes for batch 1, 8 and 64 at 1k and 8k.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import LLAMA_8B, Setup, bench_decode, gpu_timers, measure_read_bandwidth  # noqa: E402


def main() -> None:
    from engine.kernels.decode import DecodeConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", action="store_true", help="batch 256 at 1k-2k and batch 64 at 8k instead")
    args = parser.parse_args()
    shapes = ((256, 1024), (256, 1536), (256, 2048), (64, 8192)) if args.large else (
        (1, 1024), (8, 1024), (64, 1024), (1, 8192), (8, 8192))
    setup = Setup(LLAMA_8B.num_heads, LLAMA_8B.num_kv_heads, LLAMA_8B.head_dim, LLAMA_8B.block_size, shapes, (),
                  LLAMA_8B.bandwidth_elements)
    device = torch.device("cuda")
    timers = gpu_timers()
    configs: dict[str, DecodeConfig | None] = {"default": None}
    if args.large:
        for per_sm in (1, 2, 8):
            configs[f"large p{per_sm}"] = DecodeConfig(programs_per_sm_large_batch=per_sm)
        for block_n, warps, stages in ((32, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 2), (128, 8, 3), (64, 2, 3)):
            configs[f"n{block_n} w{warps} s{stages}"] = DecodeConfig(block_n=block_n, num_warps=warps,
                                                                     num_stages=stages)
    else:
        for minimum in (32, 64, 128):
            configs[f"min{minimum}"] = DecodeConfig(min_partition=minimum, block_n=min(64, minimum))
        for minimum in (64, 128):
            configs[f"min{minimum} w2"] = DecodeConfig(min_partition=minimum, num_warps=2)
            configs[f"min{minimum} n32 w2"] = DecodeConfig(min_partition=minimum, block_n=32, num_warps=2)
        configs["min128 p16"] = DecodeConfig(min_partition=128, programs_per_sm=16)
    bandwidth = measure_read_bandwidth(setup, device, timers.eager)
    print(f"read bandwidth {bandwidth / 1e12:.2f} TB/s")
    rows = bench_decode(setup, device, timers, configs)
    print("| batch x context | config | partitions | us | % of read BW |\n|---|---|---|---|---|")
    for row in rows:
        seconds = row["seconds"]
        print(f"| {row['batch']} x {row['context']} | {row['config']} | {row['partitions']} | {seconds * 1e6:.1f} "
              f"| {100 * row['bytes'] / seconds / bandwidth:.0f}% |")


if __name__ == "__main__":
    main()
