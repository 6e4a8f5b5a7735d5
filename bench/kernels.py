"""Kernel benchmarks on a GPU: HBM read bandwidth, paged decode attention bandwidth, prefill TFLOP/s.

    python3 bench/kernels.py [--out DIR] [--sweep]   # on a CUDA machine (TRITON_INTERPRET unset or 0)
    python3 bench/kernels.py --smoke                  # tiny shapes on CPU, interpreted: checks this script

Decode: one query per sequence over a uniform context, Llama-3.1-8B attention shapes (32 q heads, 8 kv heads,
head dim 128, block size 16, bf16), block tables scattered over the cache. Its bandwidth counts the K/V
bytes the call must read plus q and out, against the read bandwidth of a big bf16 sum measured in the same
run. Prefill: causal, one fresh sequence per call (plus one varlen batch), FLOPs = 4 * D * Hq * (q, k) pairs.
Decode is timed from CUDA-graph replays (GPU time; the replays rotate over disjoint block sets so no call finds
the previous one's K/V in L2) and once eagerly; prefill eagerly (triton's do_bench, L2 flushed, median).
Writes kernels-<date>.md and kernels-<date>.json under --out; prints the tables last.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
MIB = 2 ** 20
DECODE_GOAL = 0.88  # of the measured read bandwidth, where the call reads at least DECODE_GOAL_MIN_BYTES
DECODE_GOAL_MIN_BYTES = 256 * MIB
PREFILL_GOAL = 550.0  # TFLOP/s
Timer = Callable[[Callable[[], Any]], float]  # seconds per call


@dataclass(frozen=True)
class Setup:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    decode_shapes: tuple[tuple[int, int], ...]  # (batch, context)
    prefill_batches: tuple[tuple[int, ...], ...]  # sequence lengths of one call
    bandwidth_elements: int  # size of the bf16 tensor summed to measure read bandwidth


LLAMA_8B = Setup(32, 8, 128, 16, tuple((b, c) for b in (1, 8, 64) for c in (1024, 8192, 32768)),
                 ((4096,), (8192,), (16384,), (32768,), (4096,) * 8), 2 ** 31)
SMOKE = Setup(4, 2, 32, 16, ((1, 64), (2, 96)), ((40,), (24, 24)), 2 ** 16)


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "uncommitted"
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
    return head.stdout.strip() + (" + uncommitted changes" if dirty.strip() else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--sweep", action="store_true", help="also time the candidate configs of each kernel")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under Triton's interpreter")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    sys.path.insert(0, str(REPO))
    device = torch.device("cpu" if args.smoke else "cuda")
    setup = SMOKE if args.smoke else LLAMA_8B
    timers = Timers(wall_timer, wall_timer) if args.smoke else gpu_timers()
    results = run_suite(setup, device, timers, args.sweep)
    write_report(results, setup, device, args.out)


@dataclass(frozen=True)
class Timers:
    eager: Timer  # launches from Python each call, L2 flushed between calls: what an eager caller sees
    graph: Timer  # replays of a CUDA graph of many calls: the GPU time alone, as a graph-captured decode sees


def gpu_timers() -> Timers:
    from triton.testing import do_bench, do_bench_cudagraph

    return Timers(lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3,
                  lambda fn: do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e-3)


def wall_timer(fn: Callable[[], Any]) -> float:
    fn()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_suite(setup: Setup, device: torch.device, timers: Timers, sweep: bool) -> dict[str, Any]:
    from engine.kernels.decode import DecodeConfig
    from engine.kernels.prefill import PrefillConfig

    decode_configs: dict[str, DecodeConfig | None] = {"default": None}
    prefill_configs: dict[str, PrefillConfig | None] = {"default": None}
    if sweep:
        for block_n, warps, stages, per_sm in [(64, 4, 3, 4), (64, 4, 3, 16), (64, 4, 4, 8), (128, 4, 3, 4),
                                               (64, 2, 4, 8)]:
            decode_configs[f"n{block_n} w{warps} s{stages} p{per_sm}"] = DecodeConfig(block_n, warps, stages,
                                                                                      per_sm, per_sm)
        for block_m, block_n, warps, stages, specialize in [(128, 64, 8, 3, False), (64, 64, 4, 3, False),
                                                            (128, 128, 8, 3, True), (128, 64, 8, 3, True)]:
            name = f"m{block_m} n{block_n} w{warps} s{stages}" + (" ws" if specialize else "")
            prefill_configs[name] = PrefillConfig(block_m, block_n, warps, stages, specialize)
    read_bandwidth = measure_read_bandwidth(setup, device, timers.eager)
    checks = check_kernels(setup, device)
    return {"read_bandwidth": read_bandwidth, "checks": checks,
            "decode": bench_decode(setup, device, timers, decode_configs),
            "prefill": bench_prefill(setup, device, timers.eager, prefill_configs)}


def timed_variants(timer: Timer, configs: dict[str, Any], call: Callable[..., torch.Tensor]
                   ) -> dict[str, dict[str, Any]]:
    """Time call(config=...) for each config; a config that fails to build or run is recorded, not fatal.

    Each variant's output is compared with the default config's (relative error), so a fast wrong variant
    shows up in the sweep table.
    """
    results: dict[str, dict[str, Any]] = {}
    baseline = call(config=configs["default"]).float()
    for name, config in configs.items():
        try:
            error = relative_error(call(config=config), baseline)
            results[name] = {"seconds": timer(functools.partial(call, config=config)), "error_vs_default": error}
        except Exception as exc:  # noqa: BLE001 - a compile failure of one candidate must not end the sweep
            results[name] = {"seconds": float("nan"), "failed": f"{type(exc).__name__}: {str(exc)[:200]}"}
        print(f"  {name}: {results[name]}", flush=True)
    return results


def measure_read_bandwidth(setup: Setup, device: torch.device, timer: Timer) -> float:
    data = torch.empty(setup.bandwidth_elements, dtype=torch.bfloat16, device=device).normal_()
    seconds = timer(lambda: data.sum())
    return data.numel() * data.element_size() / seconds


def make_cache(setup: Setup, num_tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, shuffled block ids): the engine's pool layout [blocks, kv_heads, layers, 2, block_size,
    head_dim] (engine/profile_run.py) with one layer, viewed as [blocks, block_size, kv_heads, head_dim]."""
    num_blocks = num_tokens // setup.block_size + 1
    kv = torch.empty(num_blocks, setup.num_kv_heads, 1, 2, setup.block_size, setup.head_dim, dtype=torch.bfloat16,
                     device=device).normal_()
    return (kv[:, :, 0, 0].transpose(1, 2), kv[:, :, 0, 1].transpose(1, 2),
            torch.randperm(num_blocks, device=device).to(torch.int32))


def check_kernels(setup: Setup, device: torch.device) -> dict[str, float]:
    """Relative error of each attention kernel vs the torch reference on a ragged batch; abort if off."""
    from engine.kernels import reference
    from engine.kernels.decode import paged_decode_attention
    from engine.kernels.prefill import paged_prefill_attention

    seq_lens = [5, 300, 1000, 777] if device.type == "cuda" else [5, 30, 41]
    query_lens = [5, 100, 1, 777] if device.type == "cuda" else [5, 7, 1]
    width = max(seq_lens) // setup.block_size + 1
    k_cache, v_cache, block_ids = make_cache(setup, len(seq_lens) * width * setup.block_size, device)
    tables = block_ids[:len(seq_lens) * width].view(len(seq_lens), width)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    starts = torch.tensor([sum(query_lens[:b]) for b in range(len(query_lens) + 1)], dtype=torch.int32,
                          device=device)
    scale = setup.head_dim ** -0.5
    errors = {}
    q = torch.randn(len(seq_lens), setup.num_heads, setup.head_dim, device=device, dtype=torch.bfloat16)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, None)
    expected = reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, None)
    errors["decode"] = relative_error(out, expected)
    q = torch.randn(sum(query_lens), setup.num_heads, setup.head_dim, device=device, dtype=torch.bfloat16)
    out = paged_prefill_attention(q, k_cache, v_cache, tables, starts, lens, scale, None)
    expected = reference.paged_prefill_attention(q, k_cache, v_cache, tables, starts, lens, scale, None)
    errors["prefill"] = relative_error(out, expected)
    assert all(error < 2e-2 for error in errors.values()), f"kernels disagree with the reference: {errors}"
    return errors


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.double() - expected.double()).norm() / expected.double().norm()).item()


def bench_decode(setup: Setup, device: torch.device, timers: Timers, configs: dict[str, Any]
                 ) -> list[dict[str, Any]]:
    from engine.kernels.common import num_sms
    from engine.kernels.decode import decode_partitions, default_decode_config, paged_decode_attention

    k_cache, v_cache, block_ids = make_cache(setup, max(b * c for b, c in setup.decode_shapes), device)
    scale = setup.head_dim ** -0.5
    rows = []
    for batch, context in setup.decode_shapes:
        width = context // setup.block_size
        # graph replays rotate over disjoint block sets, so no call finds the previous one's K/V in L2
        num_sets = max(1, min(4, block_ids.numel() // (batch * width)))
        tables = [block_ids[i * batch * width:(i + 1) * batch * width].view(batch, width) for i in range(num_sets)]
        lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        q = torch.randn(batch, setup.num_heads, setup.head_dim, device=device, dtype=torch.bfloat16)
        kv_bytes = batch * context * setup.num_kv_heads * setup.head_dim * 2 * k_cache.element_size()

        def rotated(config: Any, q: torch.Tensor = q, tables: list[torch.Tensor] = tables,
                    lens: torch.Tensor = lens) -> torch.Tensor:
            for table in tables:
                out = paged_decode_attention(q, k_cache, v_cache, table, lens, scale, None, config=config)
            return out

        print(f"decode {batch}x{context}", flush=True)
        timed = timed_variants(lambda fn, sets=num_sets: timers.graph(fn) / sets, configs, rotated)
        eager = timers.eager(functools.partial(paged_decode_attention, q, k_cache, v_cache, tables[0], lens, scale,
                                               None))
        for name, result in timed.items():
            chosen = configs[name] or default_decode_config(device, q.dtype)
            _, partitions = decode_partitions(chosen, num_sms(device), batch, setup.num_kv_heads,
                                              width * setup.block_size)
            rows.append({"batch": batch, "context": context, "config": name, "partitions": partitions,
                         "bytes": kv_bytes + 2 * q.numel() * q.element_size(), **result,
                         "eager_seconds": eager if name == "default" else None})
    return rows


def bench_prefill(setup: Setup, device: torch.device, timer: Timer, configs: dict[str, Any]) -> list[dict[str, Any]]:
    from engine.kernels.prefill import paged_prefill_attention

    scale = setup.head_dim ** -0.5
    rows = []
    for seq_lens in setup.prefill_batches:
        width = max(seq_lens) // setup.block_size + 1
        k_cache, v_cache, block_ids = make_cache(setup, len(seq_lens) * width * setup.block_size, device)
        tables = block_ids[:len(seq_lens) * width].view(len(seq_lens), width)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        starts = torch.tensor([sum(seq_lens[:b]) for b in range(len(seq_lens) + 1)], dtype=torch.int32,
                              device=device)
        q = torch.randn(sum(seq_lens), setup.num_heads, setup.head_dim, device=device, dtype=torch.bfloat16)
        flops = 4 * setup.head_dim * setup.num_heads * sum(n * (n + 1) // 2 for n in seq_lens)
        sequences = f"{len(seq_lens)} x {seq_lens[0]}" if len(set(seq_lens)) == 1 else str(seq_lens)
        sdpa_seconds = sdpa_time(q, setup, timer) if len(seq_lens) == 1 and device.type == "cuda" else None
        print(f"prefill {sequences}", flush=True)
        call = functools.partial(paged_prefill_attention, q, k_cache, v_cache, tables, starts, lens, scale, None,
                                 max_query_len=max(seq_lens))
        for name, result in timed_variants(timer, configs, call).items():
            rows.append({"sequences": sequences, "tokens": sum(seq_lens), "config": name, "flops": flops,
                         **result, "sdpa_seconds": sdpa_seconds})
    return rows


def sdpa_time(q: torch.Tensor, setup: Setup, timer: Timer) -> float:
    """torch's fused causal attention on dense tensors of the same shapes (k/v expanded to every q head)."""
    dense_q = q.transpose(0, 1)[None].contiguous()  # [1, Hq, N, D]
    dense_k = torch.randn_like(dense_q)
    dense_v = torch.randn_like(dense_q)
    return timer(lambda: torch.nn.functional.scaled_dot_product_attention(dense_q, dense_k, dense_v,
                                                                          is_causal=True))


def sweep_note(row: dict[str, Any]) -> str:
    return row["failed"] if "failed" in row else f"{row['error_vs_default']:.1e}"


def write_report(results: dict[str, Any], setup: Setup, device: Any, out_dir: Path) -> None:
    import triton

    today = datetime.date.today().isoformat()
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreted, smoke run)"
    bandwidth = results["read_bandwidth"]
    lines = [
        f"# Kernel benchmarks, {today}", "",
        f"- card: {card}; torch {torch.__version__}, triton {triton.__version__}",
        f"- commit: {commit()}",
        f"- attention shapes: {setup.num_heads} q heads, {setup.num_kv_heads} kv heads, head dim "
        f"{setup.head_dim}, block size {setup.block_size}, bf16, scattered block tables",
        f"- HBM read bandwidth (median of a {setup.bandwidth_elements * 2 / 2**30:.0f} GiB bf16 sum): "
        f"{bandwidth / 1e12:.2f} TB/s", "",
        "## Decode attention (default config)", "",
        f"Goal: >= {DECODE_GOAL:.0%} of the read bandwidth where the call reads >= 256 MiB.", "",
        "Time: CUDA-graph replays (GPU time, no launch overhead; how the engine's decode graphs run it).",
        "Eager: one Python call per launch, L2 flushed first (includes Triton's launch overhead).", "",
        "| batch | context | MiB read | time (us) | TB/s | of read BW | goal | eager (us) | partitions |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | :--- | ---: | ---: |",
    ]
    for row in results["decode"]:
        if row["config"] != "default":
            continue
        fraction = row["bytes"] / row["seconds"] / bandwidth
        goal = ("met" if fraction >= DECODE_GOAL else "MISSED") if row["bytes"] >= DECODE_GOAL_MIN_BYTES else "n/a"
        lines.append(f"| {row['batch']} | {row['context']} | {row['bytes'] / MIB:.0f} | {row['seconds'] * 1e6:.1f} "
                     f"| {row['bytes'] / row['seconds'] / 1e12:.2f} | {fraction:.1%} | {goal} "
                     f"| {row['eager_seconds'] * 1e6:.1f} | {row['partitions']} |")
    lines += ["", "## Prefill attention (causal, default config)", "",
              f"Goal: >= {PREFILL_GOAL:.0f} TFLOP/s.", "",
              "| sequences | tokens | time (ms) | TFLOP/s | goal | torch SDPA TFLOP/s (dense, same shapes) |",
              "| :--- | ---: | ---: | ---: | :--- | ---: |"]
    for row in results["prefill"]:
        if row["config"] != "default":
            continue
        tflops = row["flops"] / row["seconds"] / 1e12
        sdpa = f"{row['flops'] / row['sdpa_seconds'] / 1e12:.0f}" if row.get("sdpa_seconds") else "-"
        lines.append(f"| {row['sequences']} | {row['tokens']} | {row['seconds'] * 1e3:.2f} | {tflops:.0f} "
                     f"| {'met' if tflops >= PREFILL_GOAL else 'MISSED'} | {sdpa} |")
    if any(row["config"] != "default" for row in results["decode"] + results["prefill"]):
        lines += ["", "## Sweep (decode graph-timed, prefill eager)", "",
                  "| kernel | shape | config | time (us) | rate | error vs default |",
                  "| :--- | :--- | :--- | ---: | ---: | ---: |"]
        for row in results["decode"]:
            rate = f"{row['bytes'] / row['seconds'] / bandwidth:.1%} of BW"
            lines.append(f"| decode | {row['batch']}x{row['context']} | {row['config']} | "
                         f"{row['seconds'] * 1e6:.1f} | {rate} | {sweep_note(row)} |")
        for row in results["prefill"]:
            rate = f"{row['flops'] / row['seconds'] / 1e12:.0f} TFLOP/s"
            lines.append(f"| prefill | {row['sequences']} | {row['config']} | {row['seconds'] * 1e6:.1f} | {rate} "
                         f"| {sweep_note(row)} |")
    lines += ["", "## Correctness checks run before timing (relative error vs the torch reference)", ""]
    lines += [f"- {name}: {error:.2e}" for name, error in results["checks"].items()]
    report = "\n".join(lines) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"kernels-{today}.md").write_text(report)
    (out_dir / f"kernels-{today}.json").write_text(json.dumps({"setup": asdict(setup), **results}, indent=1))
    print(report)


if __name__ == "__main__":
    main()
