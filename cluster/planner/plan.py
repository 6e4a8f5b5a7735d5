"""`tandem plan`: how many prefill and decode nodes (and which colocation threshold) serve a load under the SLOs,
at the least node count, as DistServe places: an analytic estimate from the node profile (capacity.py), then
checked, and adjusted, with the simulator (benchmark/sim): a pool whose SLO the simulated run misses gets a node
more until it meets it, then each pool gives back nodes while the run still meets both SLOs.

    tandem plan --profile node.json --slo-ttft-ms 500 --slo-itl-ms 50 --request-rate 10 --input-len 1024 \\
                --output-len 128 [--range-ratio 0.5] [--slo-percentile 90] [--no-sim] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmark.profile import Profile, ProfileError, load_profile
from cluster.planner.capacity import Load, NodeCapacity, capacity
from cluster.planner.types import SLO, PoolSizes

MAX_SIM_REQUESTS = 1500
MAX_SIM_RUNS = 40


class PlanError(Exception):
    """A plan that cannot be made (a bad profile, an SLO no node meets); the message says why."""


@dataclass(frozen=True)
class SimCheck:
    ttft_s: float  # at the SLO's percentile
    itl_s: float
    failed: int

    def meets(self, slo: SLO) -> bool:
        return self.failed == 0 and self.ttft_s <= slo.ttft_s and self.itl_s <= slo.itl_s


@dataclass(frozen=True)
class Candidate:
    colocate_max_tokens: int
    capacity: NodeCapacity
    analytic: PoolSizes | None  # None: no node count meets the SLOs
    checked: PoolSizes | None = None  # after the simulator; None: not simulated, or it found no count
    check: SimCheck | None = None  # the simulated run of `checked`

    @property
    def answer(self) -> PoolSizes | None:
        return self.checked if self.check is not None else self.analytic


@dataclass(frozen=True)
class Plan:
    load: Load
    slo: SLO
    candidates: tuple[Candidate, ...]
    simulated: bool

    @property
    def best(self) -> Candidate | None:
        feasible = [c for c in self.candidates if c.answer is not None and (c.check is None or c.check.meets(self.slo))]
        return min(feasible, key=lambda c: (c.answer.total, c.colocate_max_tokens)) if feasible else None  # type: ignore[union-attr]


def colocate_candidates(profile: Profile, load: Load) -> list[int]:
    """0 (always disaggregate), and thresholds at the shortest, the mean and the longest prompt (within the step's
    token budget: a longer prompt would stall D's decode steps for several chunks)."""
    lengths = load.prompt_lengths()
    budget = profile.node.max_num_batched_tokens
    points = {0, min(lengths), round(load.input_len), max(lengths)}
    return sorted(p for p in points if p <= budget)


def analytic(profile: Profile, slo: SLO, load: Load, colocate_max_tokens: int) -> Candidate:
    cap = capacity(profile, slo, load, colocate_max_tokens)
    sizes = cap.nodes(load.rate)
    feasible = sizes.prefill > 0 and sizes.decode > 0
    return Candidate(colocate_max_tokens, cap, sizes if feasible else None)


def workload(load: Load, duration_s: float, seed: int) -> list[Any]:
    """Poisson arrivals at the load's rate, lengths drawn as `tandem bench serve --range-ratio` draws them."""
    from benchmark.sim import SimRequest

    rng = random.Random(seed)

    def draw(base: float) -> int:
        if load.range_ratio <= 0:
            return max(1, round(base))
        return rng.randint(max(1, int(base * (1 - load.range_ratio))), max(1, int(base * (1 + load.range_ratio))))

    requests, t = [], 0.0
    count = max(50, min(MAX_SIM_REQUESTS, round(load.rate * duration_s)))
    for _ in range(count):
        t += rng.expovariate(load.rate)
        requests.append(SimRequest(arrival_s=t, prompt_tokens=draw(load.input_len),
                                   output_tokens=draw(load.output_len)))
    return requests


def simulate_check(profile: Profile, slo: SLO, sizes: PoolSizes, colocate_max_tokens: int,
                   requests: list[Any]) -> SimCheck:
    from benchmark.sim import simulate

    result = simulate(profile=profile, requests=requests, prefill_nodes=sizes.prefill, decode_nodes=sizes.decode,
                      colocate_max_tokens=colocate_max_tokens, percentiles=(slo.percentile,),
                      cores=0)  # a plan's nodes each have their own hardware (profile.cores: the box measured)
    metrics = result.metrics

    def at_percentile(name: str) -> float:
        dist = metrics.distributions.get(name)
        if dist is None or not dist.percentiles or metrics.completed == 0:
            return math.inf
        return dist.percentiles[0][1] / 1000.0

    return SimCheck(at_percentile("ttft"), at_percentile("itl"), metrics.failed)


def adjust(profile: Profile, slo: SLO, candidate: Candidate, requests: list[Any], max_nodes: int,
           budget: list[int]) -> Candidate:
    """The candidate's analytic sizes, grown until the simulated run meets both SLOs, then shrunk while it
    still does. `budget`: simulator runs left (shared by the candidates)."""
    if candidate.analytic is None:
        return candidate
    all_colocated = candidate.capacity.colocated_share >= 1

    def run(sizes: PoolSizes) -> SimCheck:
        budget[0] -= 1
        return simulate_check(profile, slo, sizes, candidate.colocate_max_tokens, requests)

    sizes = candidate.analytic
    check = run(sizes)
    while not check.meets(slo) and sizes.total < max_nodes and budget[0] > 0:
        ttft_missed = check.ttft_s > slo.ttft_s and not all_colocated
        sizes = (replace(sizes, prefill=sizes.prefill + 1) if ttft_missed and check.itl_s <= slo.itl_s
                 else replace(sizes, decode=sizes.decode + 1))
        check = run(sizes)
    if not check.meets(slo):
        return replace(candidate, checked=None, check=check)
    for role in ("prefill", "decode"):
        while getattr(sizes, role) > 1 and budget[0] > 0:
            smaller = replace(sizes, **{role: getattr(sizes, role) - 1})
            smaller_check = run(smaller)
            if not smaller_check.meets(slo):
                break
            sizes, check = smaller, smaller_check
    return replace(candidate, checked=sizes, check=check)


def make_plan(profile: Profile, slo: SLO, load: Load, simulate: bool = True, duration_s: float = 120.0,
              seed: int = 0, max_nodes: int = 64) -> Plan:
    if load.rate <= 0 or load.input_len < 1 or load.output_len < 1:
        raise PlanError("the load needs a positive --request-rate, --input-len and --output-len")
    candidates = [analytic(profile, slo, load, t) for t in colocate_candidates(profile, load)]
    if simulate:
        requests = workload(load, duration_s, seed)
        budget = [MAX_SIM_RUNS]
        # the analytically cheapest first, so that the shared budget goes to the likely answers
        order = sorted(range(len(candidates)), key=lambda i: (candidates[i].analytic or PoolSizes(999, 999)).total)
        for i in order:
            candidates[i] = adjust(profile, slo, candidates[i], requests, max_nodes, budget)
    return Plan(load, slo, tuple(candidates), simulate)


def _sizes(sizes: PoolSizes | None) -> str:
    return "-" if sizes is None else f"{sizes.prefill}P+{sizes.decode}D"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or math.isinf(seconds) else f"{seconds * 1000:.1f}"


def render(plan: Plan) -> str:
    p = plan.slo.percentile
    lines = [f"{'colocate':>8} {'P req/s':>8} {'D req/s':>8} {'D batch':>7} {'analytic':>9} {'simulated':>9} "
             f"{f'TTFT p{p:g} ms':>13} {f'ITL p{p:g} ms':>12}  verdict"]
    for c in plan.candidates:
        cap = c.capacity
        verdict = ("no node count meets the SLOs" if c.analytic is None
                   else "not simulated" if not plan.simulated
                   else "meets the SLOs" if c.check is not None and c.check.meets(plan.slo)
                   else "misses the SLOs (simulated)")
        p_rate = "all D" if math.isinf(cap.prefill_rate) else f"{cap.prefill_rate:.2f}"
        lines.append(f"{c.colocate_max_tokens:>8} {p_rate:>8} {cap.decode_rate:>8.2f} {cap.decode_batch:>7} "
                     f"{_sizes(c.analytic):>9} {_sizes(c.checked):>9} "
                     f"{_ms(c.check.ttft_s if c.check else None):>13} {_ms(c.check.itl_s if c.check else None):>12}"
                     f"  {verdict}")
    load = plan.load
    spread = f" (±{load.range_ratio:.0%})" if load.range_ratio > 0 else ""
    head = (f"{load.rate:g} req/s, prompts of {load.input_len:g}{spread} tokens, outputs of {load.output_len:g}; "
            f"TTFT p{p:g} <= {plan.slo.ttft_s * 1000:g} ms, ITL p{p:g} <= {plan.slo.itl_s * 1000:g} ms")
    best = plan.best
    if best is None or best.answer is None:
        answer = f"{head}: no candidate meets the SLOs (relax them, or a faster node)"
    else:
        answer = (f"{head}: {best.answer.prefill} prefill + {best.answer.decode} decode nodes "
                  f"({best.answer.total} in all), --colocate-max-tokens {best.colocate_max_tokens}")
    return "\n".join([*lines, "", answer])


def to_json(plan: Plan) -> dict[str, Any]:
    def sized(s: PoolSizes | None) -> dict[str, int] | None:
        return None if s is None else {"prefill": s.prefill, "decode": s.decode}

    best = plan.best
    return {"load": asdict(plan.load), "slo": asdict(plan.slo), "simulated": plan.simulated,
            "candidates": [{"colocate_max_tokens": c.colocate_max_tokens,
                            "capacity": {k: (None if isinstance(v, float) and math.isinf(v) else v)
                                         for k, v in asdict(c.capacity).items()},
                            "analytic": sized(c.analytic), "checked": sized(c.checked),
                            "check": None if c.check is None else asdict(c.check)} for c in plan.candidates],
            "answer": None if best is None else {**(sized(best.answer) or {}),
                                                  "colocate_max_tokens": best.colocate_max_tokens}}


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", required=True, type=Path, help="a node profile (`tandem profile`)")
    parser.add_argument("--slo-ttft-ms", required=True, type=float, help="time-to-first-token objective")
    parser.add_argument("--slo-itl-ms", required=True, type=float, help="inter-token-latency objective")
    parser.add_argument("--slo-percentile", type=float, default=90.0, help="of the requests (default 90)")
    parser.add_argument("--request-rate", required=True, type=float, help="requests per second")
    parser.add_argument("--input-len", required=True, type=float, help="mean prompt tokens")
    parser.add_argument("--output-len", required=True, type=float, help="mean output tokens")
    parser.add_argument("--range-ratio", type=float, default=0.0,
                        help="lengths uniform over [len (1 - r), len (1 + r)], as `tandem bench serve`'s")
    parser.add_argument("--no-sim", action="store_true", help="the analytic estimate only")
    parser.add_argument("--sim-duration-s", type=float, default=120.0, help="simulated load duration (default 120)")
    parser.add_argument("--seed", type=int, default=0, help="the simulated workload's seed")
    parser.add_argument("--max-nodes", type=int, default=64, help="the simulator adds nodes up to this many")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def run_plan(args: argparse.Namespace) -> int:
    """`tandem plan`; raises PlanError for what the user can fix."""
    if not 0 < args.slo_percentile < 100 or args.slo_ttft_ms <= 0 or args.slo_itl_ms <= 0:
        raise PlanError("the SLOs must be positive and --slo-percentile within (0, 100)")
    if not 0 <= args.range_ratio < 1:
        raise PlanError("--range-ratio must be within [0, 1)")
    try:
        profile = load_profile(args.profile)
    except ProfileError as e:
        raise PlanError(str(e)) from None
    slo = SLO(args.slo_ttft_ms / 1000, args.slo_itl_ms / 1000, args.slo_percentile)
    load = Load(args.request_rate, args.input_len, args.output_len, args.range_ratio)
    plan = make_plan(profile, slo, load, simulate=not args.no_sim, duration_s=args.sim_duration_s, seed=args.seed,
                     max_nodes=args.max_nodes)
    print(json.dumps(to_json(plan), indent=2) if args.json else render(plan))
    return 0 if plan.best is not None else 1
