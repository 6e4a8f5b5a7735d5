"""Where a decode step's GPU time goes: per-kernel device time of eager steps (Llama-3.1-8B shape, dummy bf16).

    python3 bench/h200/step_profile.py [--batches 1,64] [--context 1024]

Eager, so every kernel shows in the profile; the kernels are those a CUDA graph replays (graph replay removes the
launch gaps, not the kernels' own time). Prints, per batch, the top kernels by total device time per step.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.tp_step import LLAMA_31_8B  # noqa: E402


def kernel_totals(prof: profile) -> tuple[dict[str, float], dict[str, int]]:
    """Device microseconds and launches per kernel name over a profiled span."""
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] = totals.get(event.name, 0.0) + event.device_time
            counts[event.name] = counts.get(event.name, 0) + 1
    return totals, counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    from engine import LLM, SamplingParams

    config_dir = Path(tempfile.mkdtemp())
    (config_dir / "config.json").write_text(json.dumps(LLAMA_31_8B))
    batches = [int(b) for b in args.batches.split(",")]
    # the first requests decode while the last prompts prefill (8192 tokens a step): none may finish before the
    # profiled steps
    max_tokens = max(batches) * args.context // 8192 + args.steps + 16
    llm = LLM(model=str(config_dir), dtype="bfloat16", load_format="dummy", max_num_seqs=max(batches),
              max_num_batched_tokens=8192, max_model_len=args.context + max_tokens + 16, skip_tokenizer_init=True,
              enforce_eager=True)
    engine = llm.engine
    for batch in batches:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        ids = [f"p{batch}-{i}" for i in range(batch)]
        for i, rid in enumerate(ids):
            engine.add_request(rid, [(7 * i + j) % 1000 + 10 for j in range(args.context)], params)
        while any(engine.requests[r].num_output_tokens == 0 for r in ids):
            engine.step()
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
        totals, counts = kernel_totals(prof)
        total = sum(totals.values()) / args.steps
        print(f"\n## batch {batch}: device time per step {total / 1e3:.3f} ms (sum of kernel times)")
        print("| us/step | % | launches/step | kernel |\n|---|---|---|---|")
        for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:22]:
            print(f"| {us / args.steps:.1f} | {100 * us / args.steps / total:.1f} | {counts[name] / args.steps:.0f} "
                  f"| {name[:110]} |")
        for rid in ids:
            engine.abort(rid)


if __name__ == "__main__":
    main()
