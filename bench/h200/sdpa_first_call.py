"""What a prompt length the engine has not seen before costs on its first dense attention call (torch SDPA on
cuDNN builds an execution plan per shape), against the same call once warm.

    python3 bench/h200/sdpa_first_call.py [--lengths 1024,1040,1500,2048,3000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from engine.kernels.backend import dense_causal_attention  # noqa: E402


def timed_call(length: int, heads: int = 32, kv_heads: int = 8, dim: int = 128) -> float:
    q = torch.randn(length, heads, dim, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(length, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    torch.cuda.synchronize()
    start = time.perf_counter()
    dense_causal_attention(q, k, v, dim ** -0.5)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,1040,1500,2048,3000")
    args = parser.parse_args()
    timed_call(64)  # the process's first call (library loads) is not a length's
    print("| prompt tokens | first call ms | second call ms |\n|---|---|---|")
    for length in [int(n) for n in args.lengths.split(",")]:
        first, second = timed_call(length), timed_call(length)
        print(f"| {length} | {first * 1e3:.1f} | {second * 1e3:.2f} |", flush=True)


if __name__ == "__main__":
    main()
