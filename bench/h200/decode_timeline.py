"""The device timeline of the offline run's steps (issue 12): what the GPU does in a step besides the model's kernels.

    python3 bench/h200/decode_timeline.py [--num-prompts 256 --prompt-len 1024] [--steps 6] [--trace-dir DIR]

The offline workload of bench/offline_gpu.py (CUDA graphs, asynchronous scheduling), driven step by step:
a few steps with prompt tokens, then decode-only steps at batch 256, each window profiled with torch.profiler
(CUDA activities), twice among the decode-only steps with --wall-steps timed unprofiled between them. Per
window it prints the device span per step, the busy time (union of the kernels, copies and fills), the idle
time and the largest idle gaps by the ops on either side, and the ops by total time. Then the decode graph
alone, replayed with the run's last inputs, timed with events: the step minus the replay is
what runs outside the graph.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.tp_step import LLAMA_31_8B  # noqa: E402

_DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def device_ops(trace_path: Path) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every kernel, copy and fill in a chrome trace, by start."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    ops = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e["name"]) for e in events
           if e.get("cat") in _DEVICE_CATEGORIES and e.get("ph") == "X"]
    return sorted(ops)


def short(name: str) -> str:
    return name[:90]


def report(ops: list[tuple[float, float, str]], num_steps: int, title: str) -> None:
    span = ops[-1][1] - ops[0][0]
    busy = 0.0
    gaps: dict[tuple[str, str], list[float]] = {}
    end = ops[0][0]
    prev = ops[0][2]
    for start, stop, name in ops:
        if start > end:
            gaps.setdefault((short(prev), short(name)), []).append(start - end)
        if stop > end:
            busy += stop - max(start, end)
            end, prev = stop, name
    totals: dict[str, list[float]] = {}
    for start, stop, name in ops:
        totals.setdefault(short(name), []).append(stop - start)
    idle = span - busy
    print(f"\n## {title}: {num_steps} steps, span {span / 1e3:.2f} ms = {span / num_steps / 1e3:.3f} ms a step; "
          f"busy {busy / num_steps / 1e3:.3f} ms, idle {idle / num_steps / 1e3:.3f} ms a step; "
          f"{len(ops) / num_steps:.0f} device ops a step")
    print("\nidle gaps by (op before -> op after), per step:\n| us/step | count/step | max us | before -> after |"
          "\n|---|---|---|---|")
    for (before, after), values in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:16]:
        print(f"| {sum(values) / num_steps:.1f} | {len(values) / num_steps:.1f} | {max(values):.1f} | "
              f"{before} -> {after} |")
    print("\nops by total device time, per step:\n| us/step | count/step | op |\n|---|---|---|")
    for name, values in sorted(totals.items(), key=lambda kv: -sum(kv[1]))[:30]:
        print(f"| {sum(values) / num_steps:.1f} | {len(values) / num_steps:.1f} | {name} |")


def profiled_steps(engine, num_steps: int, trace_path: Path) -> list[tuple[float, float, str]]:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(num_steps):
            engine.step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace_path))
    return device_ops(trace_path)


def replay_ms(graph: torch.cuda.CUDAGraph, repeats: int = 20) -> float:
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--mixed-after", type=int, default=4,
                        help="steps run before the steps with prompt tokens are profiled (later: more decodes "
                             "beside the prompts, and a chunked prompt's continuation)")
    parser.add_argument("--decode-warm-steps", type=int, default=40)
    parser.add_argument("--wall-steps", type=int, default=450)
    parser.add_argument("--trace-dir", default=None, help="where to write the gzipped chrome traces")
    args = parser.parse_args()
    from engine import LLM, SamplingParams

    config_dir = Path(tempfile.mkdtemp())
    (config_dir / "config.json").write_text(json.dumps(LLAMA_31_8B))
    llm = LLM(model=str(config_dir), dtype="bfloat16", load_format="dummy", max_num_seqs=args.num_prompts,
              max_num_batched_tokens=8192, max_model_len=args.prompt_len + args.output_len + 16,
              skip_tokenizer_init=True)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    for i, prompt in enumerate(torch.randint(10, 100_000, (args.num_prompts, args.prompt_len), generator=g).tolist()):
        engine.add_request(f"r{i}", prompt, params)
    trace_dir = Path(args.trace_dir) if args.trace_dir else Path(tempfile.mkdtemp())
    trace_dir.mkdir(parents=True, exist_ok=True)
    for _ in range(args.mixed_after):  # the first steps: prompts only, then prompts beside a few decodes
        engine.step()
    mixed = profiled_steps(engine, 3, trace_dir / "mixed.json")
    report(mixed, 3, f"steps with prompt tokens after {args.mixed_after} steps (8192 a step, decodes beside them)")
    while engine.stats().num_queued_prefill_tokens:
        engine.step()
    for _ in range(args.decode_warm_steps):
        engine.step()
    decode = profiled_steps(engine, args.steps, trace_dir / "decode.json")
    report(decode, args.steps, f"decode-only steps at batch {args.num_prompts}")
    # without the profiler: the host's wall time a step over many decode steps, against the device's busy time
    # of the profiled steps (the difference is device idle the profile would not show: host pauses)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(args.wall_steps):
        engine.step()
    torch.cuda.synchronize()
    print(f"\n{args.wall_steps} decode steps unprofiled: {(time.perf_counter() - started) / args.wall_steps * 1e3:.3f}"
          " ms a step (wall)")
    late = profiled_steps(engine, args.steps, trace_dir / "decode-late.json")
    report(late, args.steps, f"decode-only steps at batch {args.num_prompts}, {args.wall_steps} steps later")
    graphs = engine.runner.graphs
    if graphs is not None:
        bucket = graphs.bucket(args.num_prompts)
        replay = replay_ms(graphs.graphs[bucket])
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graphs.graphs[bucket].replay()
            torch.cuda.synchronize()
        prof.export_chrome_trace(str(trace_dir / "replay.json"))
        ops = device_ops(trace_dir / "replay.json")
        report(ops, 1, f"the batch-{bucket} decode graph replayed alone")
        print(f"\ngraph replay alone (events, 20 replays): {replay:.3f} ms")
    for path in trace_dir.glob("*.json"):
        with gzip.open(f"{path}.gz", "wt") as f:
            f.write(path.read_text())
        path.unlink()


if __name__ == "__main__":
    main()
