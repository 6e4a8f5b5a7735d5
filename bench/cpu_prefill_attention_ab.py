"""A/B of a prefill step's attention on the CPU: the torch path (gather + SDPA) against the AVX512-BF16 kernel
(engine/layers/cpu_prefill_attention.cpp), in one process, alternating:

    python bench/cpu_prefill_attention_ab.py [--rounds 5] [--batch 8] [--prompt 256]

Times engine/layers/attention.py: prefill_attention, sequence after sequence and layer after layer, with and without
the kernel, over SmolLM2-135M's shape (30 layers, 9 query and 3 KV heads of 64, bf16 pool laid out as the engine's,
blocks of 16 scattered at random) for a step of `batch` fresh prompts of `prompt` tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=256)
    args = parser.parse_args()

    from engine.layers import attention

    kernel_serves = attention._prefill_kernel_serves
    torch.manual_seed(0)
    layers, kv_heads, heads, head_dim, block_size = 30, 3, 9, 64, 16
    batch, prompt = args.batch, args.prompt
    blocks_per_seq = -(-prompt // block_size)
    num_blocks = batch * blocks_per_seq + 1
    pool = torch.randn(num_blocks, kv_heads, layers, 2, block_size, head_dim).bfloat16()
    tables = (torch.randperm(num_blocks - 1)[:batch * blocks_per_seq] + 1).view(batch, -1).int()
    views = [(pool[:, :, layer, 0].transpose(1, 2), pool[:, :, layer, 1].transpose(1, 2)) for layer in range(layers)]
    # the queries as the model has them: a view into the fused q/k/v projection's rows
    qkv = torch.randn(batch * prompt, (heads + 2 * kv_heads) * head_dim).bfloat16()
    q = qkv[:, :heads * head_dim].view(batch * prompt, heads, head_dim)
    assert kernel_serves(q, *views[0], None), "the kernel does not serve here (no AVX512-BF16, or not built)"

    def step() -> torch.Tensor:
        out = torch.empty_like(q)
        for k, v in views:
            for b in range(batch):
                rows = slice(b * prompt, (b + 1) * prompt)
                out[rows] = attention.prefill_attention(q[rows], k, v, tables[b], prompt, head_dim ** -0.5, None)
        return out

    sides = {"torch": lambda *a: False, "kernel": kernel_serves}
    times: dict[str, list[float]] = {side: [] for side in sides}
    outs: dict[str, torch.Tensor] = {}
    try:
        for _ in range(args.rounds):
            for side, serves in sides.items():
                attention._prefill_kernel_serves = serves  # type: ignore[assignment]
                start = time.perf_counter()
                outs[side] = step()
                times[side].append(time.perf_counter() - start)
    finally:
        attention._prefill_kernel_serves = kernel_serves  # type: ignore[assignment]
    difference = ((outs["torch"].float() - outs["kernel"].float()).norm() / outs["torch"].float().norm()).item()
    t, k = (statistics.median(times[side]) * 1e3 for side in sides)
    print(f"{batch} x {prompt}-token prompts, {layers} layers: torch {t:.1f} ms ({t / layers:.2f} ms a layer), "
          f"kernel {k:.1f} ms ({k / layers:.2f} ms a layer): {t / k:.2f}x; outputs differ by {difference:.1e} "
          f"(relative)")


if __name__ == "__main__":
    main()
