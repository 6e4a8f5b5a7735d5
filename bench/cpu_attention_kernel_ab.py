"""A/B of the CPU decode-attention kernel against its source at another revision, in one process, alternating:

    python bench/cpu_attention_kernel_ab.py --rev REV [--rounds 6]

Builds `engine/layers/cpu_paged_attention.cpp` as it was at REV (git show) next to this tree's kernel and times one
decode step's attention, layer after layer, over SmolLM2-135M's shape (30 layers, 9 query and 3 KV heads of 64, bf16
pool laid out as the engine's, blocks of 16 scattered at random) at batch 8 and 64.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", required=True)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()

    from torch.utils.cpp_extension import load_inline

    from engine.layers import cpu_kernels

    source = subprocess.run(["git", "show", f"{args.rev}:engine/layers/cpu_paged_attention.cpp"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as build:
        # the revision's kernel may include the shared header of this tree (cpu_vec.h)
        before = load_inline(name=f"attention_{args.rev[:12]}", cpp_sources=[source],
                             functions=["paged_decode_attention"], extra_cflags=["-O3", "-fopenmp", "-mavx2", "-mfma",
                                                                                  "-mf16c"],
                             extra_ldflags=["-fopenmp"], extra_include_paths=[str(ROOT / "engine/layers")],
                             build_directory=build)
    after = cpu_kernels.kernel()
    assert after is not None
    torch.manual_seed(0)
    layers, kv_heads, heads, head_dim, block_size = 30, 3, 9, 64, 16
    for batch, context in ((8, 276), (64, 276), (8, 1024)):
        blocks_per_seq = -(-context // block_size)
        num_blocks = batch * blocks_per_seq + 1
        pool = torch.randn(num_blocks, kv_heads, layers, 2, block_size, head_dim).bfloat16()
        tables = (torch.randperm(num_blocks - 1)[:batch * blocks_per_seq] + 1).view(batch, -1).int()
        seq_lens = torch.full((batch,), context, dtype=torch.int32)
        q = torch.randn(batch, heads, head_dim)
        views = [(pool[:, :, layer, 0].transpose(1, 2), pool[:, :, layer, 1].transpose(1, 2))
                 for layer in range(layers)]
        outs = [m.paged_decode_attention(q, *views[0], tables, seq_lens, head_dim ** -0.5, 0) for m in (before, after)]
        difference = ((outs[0] - outs[1]).abs().max() / outs[0].abs().max()).item()
        times: dict[str, list[float]] = {"before": [], "after": []}
        for _ in range(args.rounds):
            for side, module in (("before", before), ("after", after)):
                start = time.perf_counter()
                for k, v in views:
                    module.paged_decode_attention(q, k, v, tables, seq_lens, head_dim ** -0.5, 0)
                times[side].append((time.perf_counter() - start) / layers)
        b, a = (statistics.median(times[side]) * 1e6 for side in ("before", "after"))
        print(f"batch {batch}, context {context}: {args.rev[:12]} {b:.0f} us a layer, this tree {a:.0f} us "
              f"({b / a:.2f}x); outputs differ by {difference:.1e} (relative)")


if __name__ == "__main__":
    main()
