"""Where the host's time goes while the offline workload's steps with prompt tokens launch (issue 12: their
`runner.execute` takes as long as the step itself, ~200 ms on the H200).

    python3 bench/h200/prompt_host_probe.py [--num-prompts 64]

The offline engine (Llama-3.1-8B shape, dummy bf16, CUDA graphs, asynchronous scheduling) runs its prompt phase
(`--num-prompts` x 1024, 8192 tokens a step) twice in one process: once under cProfile (the Python functions by
own time, and the CUDA runtime calls torch makes are under their Python callers), once under torch.profiler with
CPU activities (the CUDA runtime calls by total host time: a launch that waits for a free slot in the launch
queue shows as a long cudaLaunchKernel).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.tp_step import LLAMA_31_8B  # noqa: E402


def prompt_phase(engine, seed: int, num_prompts: int, params) -> tuple[int, float]:
    g = torch.Generator().manual_seed(seed)
    for i, prompt in enumerate(torch.randint(10, 100_000, (num_prompts, 1024), generator=g).tolist()):
        engine.add_request(f"s{seed}-{i}", prompt, params)
    torch.cuda.synchronize()
    steps = 0
    started = time.perf_counter()
    while engine.stats().num_queued_prefill_tokens:
        engine.step()
        steps += 1
    torch.cuda.synchronize()
    return steps, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    args = parser.parse_args()
    from engine import LLM, SamplingParams

    config_dir = Path(tempfile.mkdtemp())
    (config_dir / "config.json").write_text(json.dumps(LLAMA_31_8B))
    llm = LLM(model=str(config_dir), dtype="bfloat16", load_format="dummy", max_num_seqs=3 * args.num_prompts,
              max_num_batched_tokens=8192, max_model_len=1024 + 64, skip_tokenizer_init=True)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    steps, seconds = prompt_phase(engine, 1, args.num_prompts, params)
    print(f"unprofiled: {steps} steps, {seconds * 1e3 / steps:.1f} ms a step")
    profiler = cProfile.Profile()
    profiler.enable()
    steps, seconds = prompt_phase(engine, 2, args.num_prompts, params)
    profiler.disable()
    print(f"under cProfile: {steps} steps, {seconds * 1e3 / steps:.1f} ms a step")
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(25)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        steps, seconds = prompt_phase(engine, 3, args.num_prompts, params)
    print(f"under torch.profiler: {steps} steps, {seconds * 1e3 / steps:.1f} ms a step")
    runtime: dict[str, list[float]] = {}
    for event in prof.events():
        if event.name.startswith("cuda") or event.name.startswith("cudnn"):
            runtime.setdefault(event.name, []).append(event.cpu_time_total)
    print("| CUDA runtime call | calls a step | host ms a step | max us |\n|---|---|---|---|")
    for name, values in sorted(runtime.items(), key=lambda kv: -sum(kv[1]))[:12]:
        print(f"| {name} | {len(values) / steps:.0f} | {sum(values) / steps / 1e3:.1f} | {max(values):.0f} |")


if __name__ == "__main__":
    main()
