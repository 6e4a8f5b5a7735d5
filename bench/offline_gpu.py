"""Offline throughput on a GPU against the roofline of the same workload, measured in one run.

    python3 bench/offline_gpu.py [--num-prompts 256 --prompt-len 1024 --output-len 1024] [--sync] [--out FILE]

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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_step import LLAMA_31_8B, hbm_read_bandwidth  # noqa: E402


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


def _trace_report(records: list[tuple[float, int, int, int]], end: float, cfg: dict, weight_bytes: int,
                  bandwidth: float) -> list[str]:
    kv_bytes_per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    times = [r[0] for r in records] + [end]
    mixed = decode = decode_floor = 0.0
    num_mixed = num_decode = 0
    ratios = []
    for i, (_, prompt_tokens, num_decodes, context) in enumerate(records):
        # the step launched at records[i] runs while the host prepares the next: charge it the next gap
        gap = times[i + 2] - times[i + 1] if i + 2 < len(times) else times[-1] - times[i]
        if prompt_tokens:
            mixed, num_mixed = mixed + gap, num_mixed + 1
        elif num_decodes:
            floor = (weight_bytes + context * kv_bytes_per_token) / bandwidth
            decode, decode_floor, num_decode = decode + gap, decode_floor + floor, num_decode + 1
            ratios.append(gap / floor)
    ratios.sort()
    median = ratios[len(ratios) // 2] if ratios else float("nan")
    return [f"steps with prompt tokens: {num_mixed}, {mixed:.2f} s; decode-only steps: {num_decode}, "
            f"{decode:.2f} s against a read floor of {decode_floor:.2f} s (median step {median:.2f}x its floor)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--sync", action="store_true", help="synchronous scheduling (each step waits for its tokens)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--trace", action="store_true",
                        help="also print where the time went: steps with prompt tokens vs decode-only steps")
    args = parser.parse_args()

    from engine import LLM, SamplingParams

    bandwidth = hbm_read_bandwidth()
    flops = matmul_rate()
    config_dir = Path(tempfile.mkdtemp())
    (config_dir / "config.json").write_text(json.dumps(LLAMA_31_8B))
    llm = LLM(model=str(config_dir), dtype="bfloat16", load_format="dummy", max_num_seqs=args.num_prompts,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.prompt_len + args.output_len + 16, skip_tokenizer_init=True,
              async_scheduling=not args.sync)
    model = llm.engine.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    num_params = sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, 100_000, (args.num_prompts, args.prompt_len), generator=g).tolist()
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([p[:64] for p in prompts[:4]], warm)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    trace = _trace_steps(llm.engine.scheduler) if args.trace else None
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_out == args.num_prompts * args.output_len, f"got {num_out} output tokens"
    prefill, decode = roofline_seconds(LLAMA_31_8B, weight_bytes, num_params, args.num_prompts, args.prompt_len,
                                       args.output_len, flops, bandwidth)
    roofline = prefill + decode
    bound = roofline + decode_compute_excess(num_params, weight_bytes, args.num_prompts, args.output_len, flops,
                                             bandwidth)
    lines = [
        f"read bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s (measured in this run)",
        f"workload: {args.num_prompts} x {args.prompt_len} in / {args.output_len} out, greedy, ignore_eos; "
        f"asynchronous scheduling: {not args.sync}",
        "",
        "| output tok/s | seconds | roofline s (prefill + decode) | roofline tok/s | of the roofline "
        "| with decode matmuls' compute s | of that bound |",
        "|---|---|---|---|---|---|---|",
        f"| {num_out / elapsed:,.0f} | {elapsed:.2f} | {roofline:.2f} ({prefill:.2f} + {decode:.2f}) "
        f"| {num_out / roofline:,.0f} | {roofline / elapsed:.2f} | {bound:.2f} | {bound / elapsed:.2f} |",
    ]
    if trace is not None:
        lines += ["", *_trace_report(trace, time.perf_counter(), LLAMA_31_8B, weight_bytes, bandwidth)]
    report = "\n".join(lines)
    print(report, flush=True)
    if args.out:
        Path(args.out).write_text(report + "\n")


if __name__ == "__main__":
    main()
