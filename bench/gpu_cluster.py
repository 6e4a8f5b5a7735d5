"""The whole Tandem path on one GPU (or two), in one command: correctness, the handoff's latency, and serving figures.

    python bench/gpu_cluster.py --out OUT_DIR [--kv-backend ipc|nixl|mooncake|auto] [--model DIR] [--gpus 2]
                                [--goodput ttft:MS tpot:MS]
    python bench/gpu_cluster.py --out OUT_DIR --tiny --device cpu --kv-backend nixl    # CPU smoke run

Two GPUs (`--gpus 2`, issue 17): P/D puts the prefill node on GPU 0 and the decode node on GPU 1, each with its
GPU's memory; colocated runs a decode node on each GPU behind the proxy (two engines that prefill for themselves,
the same two GPUs). `--goodput` adds goodput under those SLOs to every serving point. The steps below say "the
GPU" for the one-GPU layout.

What it does (about 8 minutes on one H200 with the 8B shape; a few minutes on a CPU with --tiny):
1. Model: bench/models/llama8b-shape (Llama-3.1-8B's shape, SmolLM2's real tokenizer, config only), served with
   `--load-format dummy`: every node draws the same random bf16 weights from `--seed`. --tiny: a 4-layer model
   with the same tokenizer, written under OUT_DIR.
2. P/D phase: one prefill node and one decode node on the one GPU (each with its share of the memory, as
   `--num-kv-blocks`), and the proxy with static `--prefill/--decode` and `--colocate-max-tokens 0` (every
   request is handed from P to D). Colocated phase: one decode node alone behind the proxy, with the memory both
   nodes had. The phases run one after the other; the GPU is free between them.
3. Correctness: greedy, 32 tokens, ignore_eos, through /v1/completions (text prompts and token-id prompts): the
   P/D outputs must equal the colocated outputs token for token (and their logprobs within
   --logprob-tolerance); the proxy's metrics must show every P/D request disaggregated. Prints OK/FAIL; FAIL
   makes the exit status 1 (the figures are still written).
4. Latency: time to first token and first -> second token on the nodes' gRPC services, P/D (Prefill on P, then
   Generate on D with the ticket: the KV pull is in the second token) vs colocated (Generate on D alone).
5. Serving: `tandem bench serve` (python -m benchmark serve) against the proxy, random prompts, 1024 in / 256
   out at concurrency 1, 16, 64 and 8192 in / 128 out at 1, 16 (--long-concurrency 1,16,64 adds 64), the same
   prompts in both modes; then transformers' `generate` (random bf16 weights, batch 1 and 16, 1024 in / 256
   out) as the naive baseline. A time budget (--time-budget-s) skips the points that would start past their
   phase's share of it.
Writes OUT_DIR/results.json (everything, rewritten after each step, so a run cut short keeps what it did),
OUT_DIR/results.md, raw/ (bench serve result files), logs/ (nodes, proxy, bench); prints the Markdown last.

On the H200 (no internet; python 3.12, torch 2.11 + CUDA 13, transformers, grpcio 1.84 there): bring cp312 wheels
of what the box lacks (starlette, uvicorn, click, redis; grpcio >= 1.85.1 and protobuf >= 7.35.1, which the
generated stubs in protos/ require; nixl + nixl-cu13 for --kv-backend nixl), then

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    timeout 590 python3 bench/gpu_cluster.py --out $OUT/gpu-cluster --kv-backend ipc

A preflight (seconds) imports what the nodes, proxy and client import and fails with the import's message.
The KV backend's library must be importable (nixl: the nixl + nixl-cu13 wheels; ipc: nothing).
For NIXL on a GPU the nodes get UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y (UCX allows cuda_ipc GETs only with it when NVML
reports no NVLink, as in the H200 VM: docs/environment.md#ucx-and-nixl); --node-env KEY=VALUE adds or overrides
variables, --node-args appends flags to both nodes (e.g. "--gpu-memory-utilization 0.45" where the nodes take it).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cluster_procs import ROOT, Child, ProcessFailed, child_env, start_node, start_proxy, wait_node  # noqa: E402
from bench.gpu_cluster_checks import (  # noqa: E402
    BenchPoint,
    Completion,
    compare_outputs,
    correctness_prompts,
    greedy_outputs,
    kv_transfer_stats,
    measure_latency,
    pd_decisions,
    point_record,
    run_bench,
)
from bench.gpu_cluster_plan import Plan, device_info, make_plan, node_flags  # noqa: E402
from bench.gpu_cluster_report import markdown_report  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", type=Path, required=True, help="results, logs and (with --tiny) the model go here")
    p.add_argument("--model", type=Path, default=None, help="a config-only model directory (default: the 8B shape, "
                                                            "or with --tiny a 4-layer model written under --out)")
    p.add_argument("--tiny", action="store_true", help="a tiny model and small workloads (CPU smoke run)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--gpus", type=int, default=1, choices=(1, 2),
                   help="2: P on GPU 0 and D on GPU 1; colocated: a decode node on each GPU behind the proxy")
    p.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS",
                   help="SLOs for the serving points' goodput, as `tandem bench serve --goodput` takes them")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--kv-backend", default="ipc",
                   help="ipc (same host), nixl, mooncake, or auto (ipc here, nixl across hosts: needs nixl)")
    p.add_argument("--kv-cross-host-backend", default="nixl", choices=("nixl", "mooncake"),
                   help="with --kv-backend auto: the nodes' backend for peers on other hosts (its library must load)")
    p.add_argument("--seed", type=int, default=0, help="the dummy weights' seed (the same on every node)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default 8192 (--tiny: 2048)")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs on the nodes")
    p.add_argument("--gpu-memory-gib", type=float, default=None, help="default: the GPU's total memory")
    p.add_argument("--memory-fraction", type=float, default=0.9, help="of the GPU, for the nodes together")
    p.add_argument("--node-reserve-gib", type=float, default=6.0,
                   help="per node, besides weights and KV: CUDA context, activations, CUDA graphs")
    p.add_argument("--prefill-kv-share", type=float, default=0.25, help="P's part of the P/D KV memory")
    p.add_argument("--short-concurrency", default=None, help="default 1,16,64 (--tiny: 1,4)")
    p.add_argument("--long-concurrency", default=None, help="default 1,16 (--tiny: 1,2)")
    p.add_argument("--prompts-per-concurrency", type=int, default=2, help="num_prompts = max(4, this x concurrency)")
    p.add_argument("--latency-runs", type=int, default=6)
    p.add_argument("--logprob-tolerance", type=float, default=0.05)
    p.add_argument("--skip-hf", action="store_true", help="no transformers baseline")
    p.add_argument("--time-budget-s", type=float, default=480.0,
                   help="bench points that would start past their phase's share of it are skipped")
    p.add_argument("--node-start-timeout-s", type=float, default=420.0)
    p.add_argument("--node-env", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--node-args", default="", help="extra flags for both nodes (one shell-quoted string)")
    return p.parse_args(argv)


class Run:
    """The results so far; saved after every step."""

    def __init__(self, args: argparse.Namespace, plan: Plan) -> None:
        self.args, self.plan = args, plan
        self.started = time.monotonic()
        self.data: dict[str, Any] = {"plan": asdict(plan), "correctness": {}, "latency": [], "serving": [],
                                     "kv_transfer": {}, "hf_generate": [], "errors": []}
        self.outputs: dict[str, list[Completion]] = {}
        (args.out / "raw").mkdir(parents=True, exist_ok=True)
        (args.out / "logs").mkdir(parents=True, exist_ok=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def save(self) -> None:
        self.data["elapsed_s"] = round(self.elapsed(), 1)
        (self.args.out / "results.json").write_text(json.dumps(self.data, indent=2) + "\n")

    def error(self, text: str) -> None:
        print(f"ERROR: {text}", flush=True)
        self.data["errors"].append(text)
        self.save()


def start_mode(run: Run, mode: str, children: list[Child]) -> tuple[str | None, str, str]:
    """P and D ("pd") or D alone ("colocated"; with two GPUs, a D on each), and the proxy; appends each child as it
    starts (so the caller stops what did start); returns (P's address or None, the first D's address, the proxy's
    URL)."""
    plan, args, logs = run.plan, run.args, run.args.out / "logs"
    model, env = Path(plan.model), dict(plan.node_env)

    def node(role: str, num_kv_blocks: int, gpu: int | None) -> tuple[Child, str]:
        flags = node_flags(plan, num_kv_blocks, args.seed, args.enforce_eager, gpu)
        child, address = start_node(role, model, flags, logs, env)
        children.append(child)
        return child, address

    t0 = time.monotonic()
    two_gpus = plan.num_gpus == 2
    # the nodes load at once: the GPUs hold them all, and the start takes one load instead of two
    if mode == "pd":
        prefill, p_address = node("prefill", plan.prefill_kv_blocks, 0 if two_gpus else None)
        decodes = [node("decode", plan.decode_kv_blocks, 1 if two_gpus else None)]
    else:
        prefill, p_address = None, None
        decodes = [node("decode", plan.colocated_kv_blocks, gpu if two_gpus else None)
                   for gpu in range(plan.num_gpus)]
    for child in (prefill, *(d for d, _ in decodes)):
        if child is not None:
            wait_node(child, args.node_start_timeout_s)
    d_addresses = [address for _, address in decodes]
    proxy_flags = ["--served-model-name", plan.served_name, "--block-size", str(plan.block_size),
                   "--max-model-len", str(plan.max_model_len), "--log-level", "warning", "--request-timeout", "600",
                   *(["--colocate-max-tokens", "0"] if mode == "pd" else [])]  # P/D: every request goes P -> D
    proxy, url = start_proxy(model, p_address, d_addresses, proxy_flags, logs)
    children.append(proxy)
    print(f"[{run.elapsed():5.0f} s] {mode}: nodes and proxy up in {time.monotonic() - t0:.0f} s ({url})", flush=True)
    return p_address, d_addresses[0], url


def bench_points(run: Run, mode: str, url: str, deadline_s: float) -> None:
    plan, logs = run.plan, run.args.out / "logs"
    model, bench_log = Path(plan.model), logs / f"bench-{mode}.log"
    # untimed: kernels compile and the allocator grows on the first prompts of each length
    for input_len in sorted({p.input_len for p in plan.points}):
        warm = BenchPoint("warmup", input_len, 4, 4, 4, seed=10_000 + input_len)
        if result := run_bench(warm, url, plan.served_name, model, None, f"{mode}-warmup", 300, bench_log):
            run.error(f"{mode} warm-up at {input_len} tokens: {result['error']}")
    for point in plan.points:
        label = f"{mode}-{point.input_len}x{point.output_len}-c{point.concurrency}"
        if run.elapsed() > deadline_s:
            run.data["serving"].append(point_record(point, mode, {"skipped": "time budget"}))
            print(f"[{run.elapsed():5.0f} s] {label}: skipped (time budget)", flush=True)
            continue
        # a hung point must not eat the rest of the device call: at most what the budget has left, plus a margin
        timeout_s = min(600.0, max(60.0, run.args.time_budget_s + 60 - run.elapsed()))
        result = run_bench(point, url, plan.served_name, model, run.args.out / "raw" / f"{label}.json", label,
                           timeout_s, bench_log, plan.goodput)
        run.data["serving"].append(point_record(point, mode, result))
        print(f"[{run.elapsed():5.0f} s] {label}: " + (result.get("error") or
              f"{result['output_throughput']:.0f} out tok/s, TTFT {result['mean_ttft_ms']:.0f} ms, "
              f"TPOT {result['mean_tpot_ms']:.1f} ms"), flush=True)
        run.save()


def run_phase(run: Run, mode: str, deadline_s: float) -> None:
    """One mode ("pd" or "colocated"): start, correctness outputs, latency, serving points, stop."""
    plan = run.plan
    vocab_size = json.loads((Path(plan.model) / "config.json").read_text())["vocab_size"]
    children: list[Child] = []
    try:
        p_address, d_address, url = start_mode(run, mode, children)
        outputs = greedy_outputs(url, plan.served_name, correctness_prompts(vocab_size), plan.correctness_tokens)
        run.outputs[mode] = outputs
        run.data["correctness"][mode] = {"outputs": [asdict(o) for o in outputs], "decisions": pd_decisions(url)}
        run.save()
        for prompt_len in plan.latency_prompt_lens:
            record = measure_latency(p_address, d_address, prompt_len, plan.latency_runs, vocab_size)
            run.data["latency"].append(record)
            print(f"[{run.elapsed():5.0f} s] {record['mode']} {prompt_len} tokens: TTFT {record['ttft_ms']:.1f} ms, "
                  f"first -> second token {record['first_to_second_ms']:.1f} ms", flush=True)
            run.save()
        bench_points(run, mode, url, deadline_s)
        run.data["kv_transfer"][mode] = kv_transfer_stats(d_address)
    except Exception as e:  # gRPC, HTTP, a dead child...: the phase ends, the run goes on to the next one
        run.error(f"{mode} phase: {type(e).__name__}: {e}")
        if not isinstance(e, ProcessFailed):  # ProcessFailed carries its child's log already
            for child in children:
                print(f"--- {child.name} ({child.log_path}), last lines:\n{child.log_tail(2000)}", flush=True)
    finally:
        for child in reversed(children):
            child.stop()
        run.save()


def run_hf(run: Run, timeout_s: float) -> None:
    plan, out = run.plan, run.args.out / "hf_generate.json"
    command = [sys.executable, str(ROOT / "bench" / "hf_generate.py"), plan.model, "--device", plan.device,
               "--dtype", plan.dtype, "--batch-sizes", plan.hf_batch_sizes, "--input-len", str(plan.hf_input_len),
               "--output-len", str(plan.hf_output_len), "--seed", str(run.args.seed), "--json", str(out)]
    env = child_env({"CUDA_VISIBLE_DEVICES": ""} if plan.device == "cpu" else {})
    with (run.args.out / "logs" / "hf_generate.log").open("wb") as log:
        try:
            code = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=max(timeout_s, 30)).returncode
        except subprocess.TimeoutExpired:
            run.error(f"transformers baseline: timed out after {timeout_s:.0f} s")
            return
    if code != 0 or not out.is_file():
        run.error(f"transformers baseline: exit code {code} (logs/hf_generate.log)")
        return
    run.data["hf_generate"] = json.loads(out.read_text())
    run.save()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    # auto loads its cross-host library next to ipc: that is the one the preflight must find
    info = device_info(args.device, args.kv_cross_host_backend if args.kv_backend == "auto" else args.kv_backend)
    plan = make_plan(args, info.get("gpu_total_bytes"))
    run = Run(args, plan)
    run.data["device_info"] = info
    print(f"model {plan.model} ({plan.dtype} on {plan.device}), KV backend {plan.kv_backend}; KV blocks: P "
          f"{plan.prefill_kv_blocks}, D {plan.decode_kv_blocks}, D alone {plan.colocated_kv_blocks}", flush=True)
    run.save()
    budget = args.time_budget_s
    run_phase(run, "pd", deadline_s=0.45 * budget)
    run_phase(run, "colocated", deadline_s=0.85 * budget)
    ok, lines = False, ["no comparison: a phase produced no outputs"]
    if "pd" in run.outputs and "colocated" in run.outputs:
        ok, lines = compare_outputs(run.outputs["pd"], run.outputs["colocated"], plan.correctness_tokens,
                                    args.logprob_tolerance)
        disaggregated = run.data["correctness"]["pd"]["decisions"].get("disaggregated", 0)
        if disaggregated < len(run.outputs["pd"]):
            ok = False
            lines.append(f"FAIL the P/D proxy disaggregated {disaggregated:g} of {len(run.outputs['pd'])} requests")
    run.data["correctness"]["ok"], run.data["correctness"]["report"] = ok, lines
    print("\n".join(["correctness (P/D vs colocated, greedy):", *lines, "OK" if ok else "FAIL"]), flush=True)
    run.save()
    if not args.skip_hf:
        run_hf(run, timeout_s=max(budget - run.elapsed(), 90) if math.isfinite(budget) else 900)
    report = markdown_report(run.data)
    (args.out / "results.md").write_text(report + "\n")
    run.save()
    print(report, flush=True)
    return 0 if ok and not run.data["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
