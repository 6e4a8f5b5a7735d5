"""The planner live on this machine over a compressed day (issue 42's live window): the same trace replayed
against `tandem serve` three times, sized three ways:
- static: fixed pools (by default `tandem plan`'s answer for the window's peak, capped by --max-prefill/--max-decode);
- threshold: 1P+1D to start, resized by the per-pool threshold autoscaler (bench/planner_baselines.py) through
  the admin API, from the proxy's /metrics (the planner's own live loop drives it);
- planner: 1P+1D to start, `tandem serve --planner` (cluster/planner/).
Each run: the share of requests within the SLOs (TTFT and TPOT), failed requests, node-seconds (nodes starting,
ready or draining, from the admin API's /status once a second) and the scale actions of each pool.

    .venv/bin/python bench/planner_live.py --profile bench/results/profile-cpu-smollm2-1thread.json \\
        --slo-ttft-ms 3000 --slo-itl-ms 200 --peak-rate 1.0 --duration-s 300 --out bench/results/planner-....md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.planner_baselines import ThresholdAutoscaler  # noqa: E402
from bench.serve_process import start_serve, stop_serve  # noqa: E402
from benchmark.client import RequestOutput, RequestSettings, send_request  # noqa: E402
from benchmark.datasets import SampleRequest, prompt_synthesizer  # noqa: E402
from benchmark.profile import load_profile  # noqa: E402
from benchmark.sim import SimRequest  # noqa: E402
from benchmark.sim.workload import DayShape, day_trace  # noqa: E402
from cluster.models import resolve_model  # noqa: E402
from cluster.planner.loop import AdminScaler, PlannerLoop  # noqa: E402
from cluster.planner.types import SLO, PoolSizes  # noqa: E402
from cluster.state import read_state  # noqa: E402

COUNTED = ("starting", "ready", "draining")


@dataclass
class Run:
    name: str
    outputs: list[RequestOutput] = field(default_factory=list)
    node_seconds: float = 0.0
    sizes: list[tuple[float, int, int]] = field(default_factory=list)  # (t, prefill desired, decode desired)


async def replay(requests: list[SimRequest], samples: list[SampleRequest], proxy_url: str, model: str,
                 run: Run) -> None:
    settings = RequestSettings(api_url=proxy_url.rstrip("/") + "/v1/completions", model=model, ignore_eos=True)
    began = time.monotonic()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0),
                                 limits=httpx.Limits(max_connections=None)) as client:
        async def one(request: SimRequest, sample: SampleRequest) -> RequestOutput:
            await asyncio.sleep(max(0.0, request.arrival_s - (time.monotonic() - began)))
            return await send_request(client, settings, sample)

        run.outputs = list(await asyncio.gather(*(one(r, s) for r, s in zip(requests, samples, strict=True))))


async def watch(admin_url: str, token: str, run: Run, stop: asyncio.Event) -> None:
    """Node-seconds and desired sizes from the admin API, once a second."""
    headers = {"Authorization": f"Bearer {token}"}
    began = last = time.monotonic()
    async with httpx.AsyncClient(timeout=5) as client:
        while not stop.is_set():
            try:
                body = (await client.get(admin_url + "/status", headers=headers)).json()
            except (httpx.HTTPError, ValueError):
                body = None
            now = time.monotonic()
            if body is not None:
                alive = sum(1 for n in body["nodes"] if n["state"] in COUNTED)
                run.node_seconds += alive * (now - last)
                pools = body["pools"]
                sizes = (pools["prefill"]["desired"], pools["decode"]["desired"])
                if not run.sizes or run.sizes[-1][1:] != sizes:
                    run.sizes.append((round(now - began, 1), *sizes))
            last = now
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            except TimeoutError:
                pass


async def measure(run: Run, requests: list[SimRequest], samples: list[SampleRequest],
                  threshold: ThresholdAutoscaler | None, interval_s: float) -> None:
    state = read_state()
    if state is None:
        raise RuntimeError("no running tandem serve (its state file is missing)")
    models = httpx.get(state.proxy_url.rstrip("/") + "/v1/models", timeout=10).json()
    stop = asyncio.Event()
    tasks = [asyncio.create_task(watch(state.admin_url, state.token, run, stop))]
    if threshold is not None:
        loop = PlannerLoop(threshold, AdminScaler(state.admin_url, state.token),  # type: ignore[arg-type]
                           [state.proxy_url.rstrip("/") + "/metrics"], interval_s)
        tasks.append(asyncio.create_task(loop.run(stop)))
    try:
        await replay(requests, samples, state.proxy_url, models["data"][0]["id"], run)
    finally:
        stop.set()
        await asyncio.gather(*tasks)


def within_slo(outputs: list[RequestOutput], slo: SLO) -> float:
    good = sum(1 for o in outputs if o.success and o.ttft <= slo.ttft_s
               and (o.output_tokens <= 1 or (o.latency - o.ttft) / (o.output_tokens - 1) <= slo.itl_s))
    return good / len(outputs) if outputs else math.nan


def actions(run: Run) -> str:
    changes = [f"{t:.0f}s {p}P{d}D" for t, p, d in run.sizes]
    return " -> ".join(changes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--slo-ttft-ms", type=float, required=True)
    parser.add_argument("--slo-itl-ms", type=float, required=True)
    parser.add_argument("--peak-rate", type=float, required=True)
    parser.add_argument("--duration-s", type=float, default=300.0)
    parser.add_argument("--short-input-len", type=int, default=64)
    parser.add_argument("--long-input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--static", default="1,2", help="the static split, prefill,decode")
    parser.add_argument("--max-prefill", type=int, default=2)
    parser.add_argument("--max-decode", type=int, default=2)
    parser.add_argument("--interval-s", type=float, default=5.0)
    parser.add_argument("--cooldown-s", type=float, default=30.0)
    parser.add_argument("--colocate-max-tokens", type=int, default=0)
    parser.add_argument("--modes", default="static,threshold,planner")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a model directory, tokenizer.json or GGUF file (default: the model `tandem serve` "
                             "serves by default, SmolLM2's GGUF)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    profile = load_profile(args.profile)
    slo = SLO(args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3, 90.0)
    day = DayShape(duration_s=args.duration_s, night_rate=args.peak_rate / 6, peak_rate=args.peak_rate, bursts=1,
                   burst_factor=2.0, burst_s=args.duration_s / 15, short_input_len=args.short_input_len,
                   long_input_len=args.long_input_len, output_len=args.output_len, range_ratio=0.5)
    requests = day_trace(day, seed=args.seed)
    synth = prompt_synthesizer(args.tokenizer or resolve_model(None, None)[0], args.seed)
    colocate = ["--proxy-args", f"--colocate-max-tokens {args.colocate_max_tokens}"]
    limits = PoolSizes(args.max_prefill, args.max_decode)
    static = PoolSizes(*(int(x) for x in args.static.split(",")))
    tmp = Path(tempfile.mkdtemp(prefix="planner-live-"))
    results = []
    for mode in args.modes.split(","):
        # fresh prompts per mode: a prefix-cache hit from the run before would flatter the one after
        samples = [SampleRequest(synth.text(r.prompt_tokens), r.prompt_tokens, r.output_tokens) for r in requests]
        run, threshold = Run(mode), None
        sizes, extra = PoolSizes(1, 1), list(colocate)
        if mode == "static":
            sizes = static
        elif mode == "threshold":
            threshold = ThresholdAutoscaler.for_profile(profile, slo, PoolSizes(1, 1), limits, args.cooldown_s)
        else:
            extra += ["--planner", "--planner-profile", str(args.profile), "--slo-ttft-ms", str(args.slo_ttft_ms),
                      "--slo-itl-ms", str(args.slo_itl_ms), "--planner-interval-s", str(args.interval_s),
                      "--planner-cooldown-s", str(args.cooldown_s), "--planner-max-prefill", str(limits.prefill),
                      "--planner-max-decode", str(limits.decode)]
        proc = start_serve(["--prefill-nodes", str(sizes.prefill), "--decode-nodes", str(sizes.decode),
                            "--node-threads", "1", *extra], tmp / f"serve-{mode}.log")
        try:
            asyncio.run(measure(run, requests, samples, threshold, args.interval_s))
        finally:
            stop_serve(proc)
        failed = sum(1 for o in run.outputs if not o.success)
        results.append((run, within_slo(run.outputs, slo), failed))
        print(f"{mode}: within SLO {results[-1][1]:.1%}, failed {failed}, node-seconds {run.node_seconds:.0f}, "
              f"sizes {actions(run)}", flush=True)
    static_ns = next((r.node_seconds for r, _, _ in results if r.name == "static"), math.nan)
    lines = [f"{len(requests)} requests over {args.duration_s:.0f} s (peak {args.peak_rate} req/s, one 2x burst, "
             f"prompts {args.short_input_len} -> {args.long_input_len}, output {args.output_len}); SLO TTFT "
             f"{args.slo_ttft_ms:.0f} ms, TPOT {args.slo_itl_ms:.0f} ms; logs {tmp}", "",
             "| sizing | within SLO | failed | node-seconds | vs static | pool sizes over time |",
             "|---|---|---|---|---|---|"]
    for run, share, failed in results:
        lines.append(f"| {run.name} | {share:.1%} | {failed} | {run.node_seconds:,.0f} | "
                     f"{run.node_seconds / static_ns:.0%} | {actions(run)} |")
    text = "\n".join(lines)
    print(text)
    (tmp / "runs.json").write_text(json.dumps([{"mode": r.name, "within_slo": s, "failed": f,
                                                "node_seconds": r.node_seconds, "sizes": r.sizes}
                                               for r, s, f in results], indent=1))
    if args.out:
        with args.out.open("a") as f:
            f.write(f"\n```bash\n.venv/bin/python {' '.join(sys.argv)}\n```\n\n{text}\n")


if __name__ == "__main__":
    main()
