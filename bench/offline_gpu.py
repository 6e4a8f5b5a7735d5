"""Offline throughput on a GPU against the roofline of the same workload, measured in one run.

    python3 bench/offline_gpu.py [--num-prompts 256 --prompt-len 1024 --output-len 1024] [--sync] [--out FILE]
                                 [--trace] [--repeat N]

Llama-3.1-8B shape with dummy bf16 weights (bench/decode_step.py's config), random prompts, greedy, ignore_eos.
The roofline is what the workload would take if every prefill token ran at the bf16 matmul rate and every
decode step read its weights and K/V at the HBM read bandwidth, both rates measured in this run:

    prefill:  (2 * params * tokens + causal attention FLOPs) / matmul rate
    decode:   sum over the steps of (weight bytes + K/V bytes read by that step) / read bandwidth

The ratio is roofline time / measured time (1.0 = at the roofline). A second, tighter bound also counts the
decode steps' matmuls at the matmul rate where that exceeds their weights' read time (at batch 256 it does).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.tp_step import LLAMA_31_8B, read_bandwidth  # noqa: E402


def matmul_rate(size: int = 8192) -> float:
    """bf16 FLOP/s of a square matmul, best of several (the rate a prefill's GEMMs can reach)."""
    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    best = float("inf")
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * size ** 3 / best


def roofline_seconds(cfg: dict, weight_bytes: int, num_params: int, num_prompts: int, prompt_len: int,
                     output_len: int, flops: float, bandwidth: float) -> tuple[float, float]:
    layers, heads, head_dim = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["head_dim"]
    kv_bytes_per_token = layers * 2 * cfg["num_key_value_heads"] * head_dim * 2
    # matmuls: 2 FLOPs per parameter per token (the embedding is a lookup, but it is tied to nothing here and
    # small against the rest); causal attention: QK^T and PV over the lower triangle
    attention = 4 * layers * heads * head_dim * prompt_len * (prompt_len + 1) / 2
    prefill = num_prompts * (2 * num_params * prompt_len + attention) / flops
    # decode step i (the first token comes with the prefill) reads every sequence's prompt_len + i tokens
    decode = sum(weight_bytes + num_prompts * (prompt_len + i) * kv_bytes_per_token
                 for i in range(1, output_len)) / bandwidth
    return prefill, decode


def decode_compute_excess(num_params: int, weight_bytes: int, num_prompts: int, output_len: int, flops: float,
                          bandwidth: float) -> float:
    """Seconds the decode steps' matmuls need beyond the weights' read time: at a large batch they are
    compute-bound (2 * params * batch FLOPs per step), which the issue's roofline does not count."""
    per_step = max(0.0, 2 * num_params * num_prompts / flops - weight_bytes / bandwidth)
    return per_step * (output_len - 1)


def _trace_steps(scheduler) -> list[tuple[float, int, int, int]]:
    """Wraps scheduler.schedule to record (time, prompt tokens, decode tokens, context tokens of the decodes)
    of every step. With asynchronous scheduling the gap between two schedule() calls is the device time of the
    step in flight once the device is the bottleneck."""
    records: list[tuple[float, int, int, int]] = []
    schedule = scheduler.schedule

    def traced():
        out = schedule()
        decodes = [s for s in out.scheduled if s.num_new_tokens == 1]
        records.append((time.perf_counter(), out.num_tokens - len(decodes), len(decodes),
                        sum(s.start + 1 for s in decodes)))
        return out

    scheduler.schedule = traced
    return records


def _trace_launches(runner) -> list[tuple[bool, float]]:
    """(has prompt tokens, seconds) of every runner.execute: launching a step should take the host's time only;
    a launch as long as the step before it waited for the device (a synchronising call)."""
    launches: list[tuple[bool, float]] = []
    execute = type(runner).execute

    def timed(batch):
        start = time.perf_counter()
        try:
            return execute(runner, batch)
        finally:
            launches.append((any(s.num_new_tokens > 1 for s in batch.scheduled), time.perf_counter() - start))

    runner.execute = timed
    return launches


def _launch_report(launches: list[tuple[bool, float]]) -> str:
    def summary(times: list[float]) -> str:
        times = sorted(times)
        return (f"median {times[len(times) // 2] * 1e3:.1f} ms, max {times[-1] * 1e3:.1f} ms, total {sum(times):.2f} s"
                if times else "none")

    return (f"host time launching steps with prompt tokens: {summary([t for p, t in launches if p])}; "
            f"decode-only: {summary([t for p, t in launches if not p])}")


def _trace_host(sampled_step_class) -> tuple[list[float], list[tuple[int, float]]]:
    """(seconds the host waited for each step's samples, (generation, seconds) of each garbage collection), from now
    on; clear both lists between runs. A host that never waits is the bottleneck: the device idles between steps."""
    import gc

    waits: list[float] = []
    collections: list[tuple[int, float]] = []
    wait = sampled_step_class.wait

    def timed_wait(self):
        start = time.perf_counter()
        wait(self)
        waits.append(time.perf_counter() - start)

    sampled_step_class.wait = timed_wait
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            collections.append((info["generation"], time.perf_counter() - started[0]))

    gc.callbacks.append(on_gc)
    return waits, collections


def _host_report(waits: list[float], collections: list[tuple[int, float]]) -> str:
    waits = sorted(waits)
    idle = sum(1 for w in waits if w < 1e-4)
    full = [s for g, s in collections if g == 2]
    paused = sum(s for _, s in collections)
    return (f"host waited for the device: median {waits[len(waits) // 2] * 1e3:.1f} ms a step, {idle} of "
            f"{len(waits)} steps not at all; garbage collections: {len(collections)} ({paused:.2f} s), full ones "
            f"{len(full)} ({sum(full):.2f} s, longest {max(full, default=0) * 1e3:.0f} ms)"
            if waits else "no step waited")


def _trace_compiles() -> list[tuple[float, float, str]]:
    """(start, end, kernel) of every Triton compilation from now on: a step that compiles a kernel (a new
    specialisation) pays seconds that a warm engine would not."""
    import triton

    runtime = triton.knobs.runtime
    compiles: list[tuple[float, float, str]] = []
    started: dict[object, float] = {}

    def before(*, key, fn, **_):
        started[key] = time.perf_counter()
        return None  # a true value would skip the compilation

    def after(*, key, fn, **_):
        compiles.append((started.pop(key, time.perf_counter()), time.perf_counter(), fn.name))
        return None

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after
    return compiles


def _trace_report(records: list[tuple[float, int, int, int]], end: float, cfg: dict, weight_bytes: int,
                  bandwidth: float, compiles: list[tuple[float, float, str]]) -> list[str]:
    kv_bytes_per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    times = [r[0] for r in records] + [end]
    mixed = decode = decode_floor = 0.0
    num_mixed = num_decode = 0
    ratios = []
    mixed_steps: list[tuple[float, int, int, int]] = []  # (gap, step index, prompt tokens, decodes)
    for i, (_, prompt_tokens, num_decodes, context) in enumerate(records):
        # the step launched at records[i] runs while the host prepares the next: charge it the next gap
        gap = times[i + 2] - times[i + 1] if i + 2 < len(times) else times[-1] - times[i]
        if prompt_tokens:
            mixed, num_mixed = mixed + gap, num_mixed + 1
            mixed_steps.append((gap, i, prompt_tokens, num_decodes))
        elif num_decodes:
            floor = (weight_bytes + context * kv_bytes_per_token) / bandwidth
            decode, decode_floor, num_decode = decode + gap, decode_floor + floor, num_decode + 1
            ratios.append(gap / floor)
    ratios.sort()
    median = ratios[len(ratios) // 2] if ratios else float("nan")
    lines = [f"steps with prompt tokens: {num_mixed}, {mixed:.2f} s; decode-only steps: {num_decode}, "
             f"{decode:.2f} s against a read floor of {decode_floor:.2f} s (median step {median:.2f}x its floor)"]
    gaps = sorted(g for g, *_ in mixed_steps)
    if gaps:
        lines.append(f"steps with prompt tokens, ms: min {gaps[0] * 1e3:.0f}, median {gaps[len(gaps) // 2] * 1e3:.0f},"
                     f" max {gaps[-1] * 1e3:.0f}; slowest (step: ms, prompt tokens, decodes): " + ", ".join(
                         f"{i}: {g * 1e3:.0f}, {p}, {d}" for g, i, p, d in sorted(mixed_steps, reverse=True)[:6]))
    start = times[0] if times else end
    lines.append(f"Triton compilations during the run: {len(compiles)}, {sum(b - a for a, b, _ in compiles):.2f} s"
                 + "".join(f"; {name} at {a - start:.2f} s ({b - a:.2f} s)" for a, b, name in compiles[:12]))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--sync", action="store_true", help="synchronous scheduling (each step waits for its tokens)")
    parser.add_argument("--fused-gate-up-silu", action=argparse.BooleanOptionalAction, default=True,
                        help="the gate_up GEMM with SiLU-and-mul in one Hopper kernel (engine/kernels/hopper_mlp.py)")
    parser.add_argument("--fused-max-rows", type=int, default=None,
                        help="take the fused kernel up to this many rows (prompt steps too), not the engine's limit")
    parser.add_argument("--out", default=None)
    parser.add_argument("--trace", action="store_true",
                        help="also print where the time went: steps with prompt tokens vs decode-only steps, "
                             "the slowest prompt steps and the Triton compilations during the run")
    parser.add_argument("--gc-threshold", type=int, default=None,
                        help="the garbage collector's first threshold after start-up (Python's default is 700)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the workload this many times in one engine (a later run shows a warm engine)")
    args = parser.parse_args()

    from engine import LLM, SamplingParams

    bandwidth = read_bandwidth(torch.device("cuda", 0))
    flops = matmul_rate()
    config_dir = Path(tempfile.mkdtemp())
    (config_dir / "config.json").write_text(json.dumps(LLAMA_31_8B))
    if args.fused_max_rows is not None:
        from engine.kernels import hopper_mlp

        hopper_mlp.MAX_ROWS = args.fused_max_rows
    started = time.perf_counter()
    llm = LLM(model=str(config_dir), dtype="bfloat16", load_format="dummy", max_num_seqs=args.num_prompts,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.prompt_len + args.output_len + 16, skip_tokenizer_init=True,
              async_scheduling=not args.sync, fused_gate_up_silu=args.fused_gate_up_silu)
    start_seconds = time.perf_counter() - started
    if args.gc_threshold is not None:
        import gc

        gc.set_threshold(args.gc_threshold, *gc.get_threshold()[1:])
    model = llm.engine.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    num_params = sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel()

    def random_prompts(seed: int, num: int, length: int) -> list[list[int]]:
        # a fresh seed per run: a repeated prompt would be a prefix-cache hit
        g = torch.Generator().manual_seed(seed)
        return torch.randint(10, 100_000, (num, length), generator=g).tolist()

    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(random_prompts(0, 4, 64), warm)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    prefill, decode = roofline_seconds(LLAMA_31_8B, weight_bytes, num_params, args.num_prompts, args.prompt_len,
                                       args.output_len, flops, bandwidth)
    roofline = prefill + decode
    bound = roofline + decode_compute_excess(num_params, weight_bytes, args.num_prompts, args.output_len, flops,
                                             bandwidth)
    lines = [
        f"read bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s (measured in this run)",
        f"workload: {args.num_prompts} x {args.prompt_len} in / {args.output_len} out, greedy, ignore_eos; "
        f"asynchronous scheduling: {not args.sync}; engine start (load, profile, graphs, warm-up) "
        f"{start_seconds:.1f} s; gc thresholds {__import__('gc').get_threshold()}",
        "",
        "| run | output tok/s | seconds | roofline s (prefill + decode) | roofline tok/s | of the roofline "
        "| with decode matmuls' compute s | of that bound |",
        "|---|---|---|---|---|---|---|---|",
    ]
    traces = []
    schedule = llm.engine.scheduler.schedule
    if args.trace:
        from engine.sampled_step import SampledStep

        waits, collections = _trace_host(SampledStep)
    for run in range(1, args.repeat + 1):
        llm.engine.scheduler.schedule = schedule
        trace = _trace_steps(llm.engine.scheduler) if args.trace else None
        launches = _trace_launches(llm.engine.runner) if args.trace else []
        if args.trace:
            waits.clear()
            collections.clear()
        compiles = _trace_compiles() if args.trace else []
        torch.cuda.synchronize()
        memory_before = torch.cuda.memory_stats()
        start = time.perf_counter()
        outputs = llm.generate(random_prompts(run, args.num_prompts, args.prompt_len), params)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
        assert num_out == args.num_prompts * args.output_len, f"got {num_out} output tokens"
        lines.append(f"| {run} | {num_out / elapsed:,.0f} | {elapsed:.2f} | {roofline:.2f} ({prefill:.2f} + "
                     f"{decode:.2f}) | {num_out / roofline:,.0f} | {roofline / elapsed:.2f} | {bound:.2f} "
                     f"| {bound / elapsed:.2f} |")
        if trace is not None:
            memory = {key: torch.cuda.memory_stats().get(key, 0) - memory_before.get(key, 0)
                      for key in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")}
            traces.append((run, [*_trace_report(trace, time.perf_counter(), LLAMA_31_8B, weight_bytes, bandwidth,
                                                compiles), _launch_report(launches),
                                 _host_report(list(waits), list(collections)),
                                 "caching allocator during the run (a retry or a device free synchronises): "
                                 + ", ".join(f"{key} {value}" for key, value in memory.items())]))
    for run, trace_lines in traces:
        lines += ["", f"run {run}:", *trace_lines]
    report = "\n".join(lines)
    print(report, flush=True)
    if args.out:
        Path(args.out).write_text(report + "\n")


if __name__ == "__main__":
    main()
