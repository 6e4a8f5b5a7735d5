"""The planner against the alternatives over a simulated day (issue 42's measure), and the paper projection.

Three ways to size the pools, each run by the simulator (benchmark/sim/) over the same day-shaped trace (diurnal
rate, bursts, prompts moving from short to long):
- static: the best fixed split for the day's peak, as `tandem plan` answers it (cluster/planner/plan.py);
- threshold: a per-pool autoscaler as the Helm chart's KEDA triggers do it (HPA's rule: desired = ceil(current x
  metric per node / target), a 10% tolerance, scale-down stabilised over a window): prefill on queued prompt
  tokens per node, decode on running requests per node;
- planner: cluster/planner/policy.py, the policy `tandem serve --planner` runs.
For each: the share of requests within the SLOs (TTFT and TPOT, vLLM's goodput rule), node-seconds, and the most
scale actions of a pool within one cooldown window.

    .venv/bin/python bench/planner_day.py --profile PROFILE.json --slo-ttft-ms 2000 --slo-itl-ms 150 \\
        --peak-rate 1.0 --duration-s 3600 [--out bench/results/planner-2026-12-07.md]
    .venv/bin/python bench/planner_day.py --profile GPU.json ... --project 8,64,512   # goodput per node at scale
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.planner_baselines import ThresholdAutoscaler  # noqa: E402
from benchmark.profile import Profile, load_profile  # noqa: E402
from benchmark.sim import Controller, SimRequest, SimResult, simulate  # noqa: E402
from benchmark.sim.workload import DayShape, day_trace  # noqa: E402
from cluster.planner.capacity import Load  # noqa: E402
from cluster.planner.plan import Candidate, make_plan  # noqa: E402
from cluster.planner.policy import Planner, PolicyConfig  # noqa: E402
from cluster.planner.types import SLO, PoolSizes  # noqa: E402


def within_slo(result: SimResult, slo: SLO) -> float:
    good = 0
    for out in result.outputs:
        if not out.success:
            continue
        tpot = (out.latency - out.ttft) / (out.output_tokens - 1) if out.output_tokens > 1 else 0.0
        good += out.ttft <= slo.ttft_s and tpot <= slo.itl_s
    return good / len(result.outputs) if result.outputs else math.nan


def most_actions_per_window(result: SimResult, cooldown_s: float) -> int:
    """The most size changes of one pool within any window of `cooldown_s` (from the timeline of desired sizes)."""
    worst = 0
    for role in ("prefill", "decode"):
        changes, last = [], None
        for t, decision in result.decisions:
            size = getattr(decision.sizes, role)
            if last is not None and size != last:
                changes.append(t)
            last = size
        for i, t in enumerate(changes):
            worst = max(worst, sum(1 for u in changes[i:] if u < t + cooldown_s))
    return worst


def run(profile: Profile, requests: list[SimRequest], sizes: PoolSizes, colocate: int,
        controller: Controller | None, interval_s: float, startup_s: float) -> SimResult:
    return simulate(profile=profile, requests=requests, prefill_nodes=sizes.prefill, decode_nodes=sizes.decode,
                    colocate_max_tokens=colocate, controller=controller, interval_s=interval_s,
                    node_startup_s=startup_s, percentiles=(50.0, 90.0), cores=0)  # each node on its own hardware


def compare(args: argparse.Namespace, profile: Profile, slo: SLO) -> str:
    day = DayShape(duration_s=args.duration_s, night_rate=args.peak_rate / 8, peak_rate=args.peak_rate,
                   bursts=3, burst_factor=2.0, burst_s=args.duration_s / 60, short_input_len=args.short_input_len,
                   long_input_len=args.long_input_len, output_len=args.output_len, range_ratio=0.5)
    requests = day_trace(day, seed=args.seed)
    peak = Load(args.peak_rate * day.burst_factor, args.long_input_len, args.output_len, range_ratio=0.5)
    plan = make_plan(profile, slo, peak)
    best = plan.best
    if best is None or best.answer is None:
        raise SystemExit(f"tandem plan found no split for the peak: {plan}")
    static, colocate = best.answer, best.colocate_max_tokens
    limits = PoolSizes(max(static.prefill * 2, 2), max(static.decode * 2, 2))
    config = PolicyConfig(slo=slo, min_sizes=PoolSizes(1, 1), max_sizes=limits, cooldown_s=args.cooldown_s,
                          colocate_max_tokens=colocate)
    threshold = ThresholdAutoscaler.for_profile(profile, slo, PoolSizes(1, 1), limits, args.cooldown_s)
    runs = {
        f"static {static.prefill}P{static.decode}D (tandem plan, peak)": run(
            profile, requests, static, colocate, None, args.interval_s, args.startup_s),
        "threshold autoscaler (KEDA/HPA rule)": run(
            profile, requests, PoolSizes(1, 1), colocate, threshold, args.interval_s, args.startup_s),
        "planner (cluster/planner/policy.py)": run(
            profile, requests, PoolSizes(1, 1), colocate, Planner(profile, config), args.interval_s,
            args.startup_s),
    }
    static_ns = next(iter(runs.values())).node_seconds
    lines = [f"{len(requests)} requests over {args.duration_s:.0f} s, peak {args.peak_rate} req/s (x2 in bursts), "
             f"prompts {args.short_input_len} -> {args.long_input_len}, output {args.output_len}; SLO TTFT "
             f"{slo.ttft_s * 1e3:.0f} ms, TPOT {slo.itl_s * 1e3:.0f} ms; interval {args.interval_s:.0f} s, cooldown "
             f"{args.cooldown_s:.0f} s, node start {args.startup_s:.0f} s; colocate_max_tokens {colocate}", "",
             "| sizing | within SLO | node-seconds | vs static | most actions of a pool per cooldown | failed |",
             "|---|---|---|---|---|---|"]
    for name, result in runs.items():
        lines.append(f"| {name} | {within_slo(result, slo):.1%} | {result.node_seconds:,.0f} | "
                     f"{result.node_seconds / static_ns:.0%} | {most_actions_per_window(result, args.cooldown_s)} | "
                     f"{result.metrics.failed} |")
    return "\n".join(lines)


def _best(profile: Profile, slo: SLO, args: argparse.Namespace, rate: float, simulate: bool,
          max_nodes: int) -> Candidate | None:
    load = Load(rate, args.long_input_len, args.output_len, 0.5)
    return make_plan(profile, slo, load, simulate=simulate, max_nodes=max(max_nodes, 64)).best


def _fits(profile: Profile, slo: SLO, args: argparse.Namespace, rate: float, simulate: bool, nodes: int) -> bool:
    best = _best(profile, slo, args, rate, simulate, nodes)
    return best is not None and best.answer is not None and best.answer.total <= nodes


def project(args: argparse.Namespace, profile: Profile, slo: SLO) -> str:
    """Goodput per node and the P:D split at cluster sizes no box here has: for each size N, the highest rate whose
    `tandem plan` answer fits in N nodes (a bisection on the rate; plans are checked by simulation up to
    --simulate-up-to nodes, analytic above)."""
    lines = ["| nodes | rate req/s | P:D | colocate <= | goodput req/s per node | checked by |",
             "|---|---|---|---|---|---|"]
    for target in (int(n) for n in args.project.split(",")):
        check = target <= args.simulate_up_to
        low, high = 0.0, 1.0
        while _fits(profile, slo, args, high, False, target):
            low, high = high, high * 2
        for _ in range(20):  # analytic bisection, then the simulator's word on the answer
            mid = (low + high) / 2
            low, high = (mid, high) if _fits(profile, slo, args, mid, False, target) else (low, mid)
        while check and low > 0 and not _fits(profile, slo, args, low, True, target):
            low *= 0.95
        best = _best(profile, slo, args, low, check, target) if low > 0 else None
        if best is None or best.answer is None:
            lines.append(f"| {target} | - | no split meets the SLOs | | | |")
            continue
        lines.append(f"| {target} | {low:.1f} | {best.answer.prefill}:{best.answer.decode} | "
                     f"{best.colocate_max_tokens} | {low / best.answer.total:.2f} | "
                     f"{'simulator' if check else 'capacity model'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--slo-ttft-ms", type=float, required=True)
    parser.add_argument("--slo-itl-ms", type=float, required=True)
    parser.add_argument("--peak-rate", type=float, required=True, help="requests/s at the day's peak")
    parser.add_argument("--duration-s", type=float, default=3600.0, help="the compressed day's length")
    parser.add_argument("--short-input-len", type=int, default=128)
    parser.add_argument("--long-input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--interval-s", type=float, default=30.0)
    parser.add_argument("--cooldown-s", type=float, default=120.0)
    parser.add_argument("--startup-s", type=float, default=20.0, help="a new node's start")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--project", default=None, help="node counts for the paper projection, e.g. 8,64,512")
    parser.add_argument("--simulate-up-to", type=int, default=64, help="check plans by simulation up to N nodes")
    parser.add_argument("--out", type=Path, default=None, help="Markdown file to append to")
    args = parser.parse_args()
    profile = load_profile(args.profile)
    slo = SLO(args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3, 90.0)
    began = time.monotonic()
    text = project(args, profile, slo) if args.project else compare(args, profile, slo)
    text += f"\n\n({time.monotonic() - began:.0f} s of simulation)"
    print(text)
    if args.out:
        with args.out.open("a") as f:
            f.write(f"\n```bash\n.venv/bin/python {' '.join(sys.argv)}\n```\n\n{text}\n")


if __name__ == "__main__":
    main()
