"""`python -m benchmark.sim`: simulate a cluster of a profile's nodes under a workload and print the report
`tandem bench serve` prints (and, with --json, write its result file with the simulator's extras)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmark.metrics import METRIC_NAMES, parse_goodput
from benchmark.profile import ProfileError, load_profile
from benchmark.results import RunInfo, build_result, format_report, save_result
from benchmark.sim.cluster import simulate
from benchmark.sim.types import SimRequest, SimResult
from benchmark.sim.workload import load_trace, random_requests


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmark.sim", description=__doc__)
    p.add_argument("--profile", type=Path, required=True, help="a node profile (`tandem profile`)")
    p.add_argument("--prefill-nodes", type=int, required=True, help="0: colocated only")
    p.add_argument("--decode-nodes", type=int, required=True)
    p.add_argument("--colocate-max-tokens", type=int, default=64, help="the router's (default 64)")
    p.add_argument("--cores", type=int, default=None, help="CPU contention bound (default: the profile's; 0: none)")
    work = p.add_mutually_exclusive_group(required=True)
    work.add_argument("--trace", type=Path, help="JSON lines of arrival_s, prompt_tokens, output_tokens")
    work.add_argument("--num-prompts", type=int, help="the random dataset's requests")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (client side)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentile-metrics", default=",".join(METRIC_NAMES))
    p.add_argument("--metric-percentiles", default="90,99")
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS")
    p.add_argument("--json", type=Path, default=None, help="write the result file here")
    return p


def workload(args: argparse.Namespace) -> list[SimRequest]:
    if args.trace is not None:
        return load_trace(args.trace)
    return random_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                           args.request_rate, args.burstiness, args.seed)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        profile = load_profile(args.profile)
        requests = workload(args)
        percentiles = [float(v) for v in args.metric_percentiles.split(",") if v.strip()]
        percentile_metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
        if unknown := set(percentile_metrics) - set(METRIC_NAMES):
            raise ValueError(f"--percentile-metrics: unknown {sorted(unknown)}")
        result = simulate(profile=profile, requests=requests, prefill_nodes=args.prefill_nodes,
                          decode_nodes=args.decode_nodes, colocate_max_tokens=args.colocate_max_tokens,
                          cores=args.cores, max_concurrency=args.max_concurrency, percentiles=percentiles,
                          goodput_slos_ms=parse_goodput(args.goodput) if args.goodput else None)
    except (ProfileError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    info = RunInfo(backend="sim", label=f"sim-{args.prefill_nodes}p{args.decode_nodes}d", model_id=profile.node.model,
                   tokenizer_id=None, num_prompts=len(requests),
                   request_rate=args.request_rate if args.trace is None else math.inf,
                   max_concurrency=args.max_concurrency,
                   dataset_name="trace" if args.trace is not None else "random", endpoint="sim",
                   burstiness=args.burstiness)
    body = build_result(info, result.metrics, result.outputs, percentile_metrics, detailed=False)
    body.update(extras(result, args))
    print(format_report(body, result.metrics, percentile_metrics))
    print(f"{'Colocated requests:':<40} {sum(result.colocated):<10}")
    print(f"{'Node-seconds:':<40} {result.node_seconds:<10.2f}")
    if args.json is not None:
        save_result(body, args.json)
    return 0


def extras(result: SimResult, args: argparse.Namespace) -> dict[str, object]:
    return {
        "sim": {"prefill_nodes": args.prefill_nodes, "decode_nodes": args.decode_nodes,
                "colocate_max_tokens": args.colocate_max_tokens, "cores": args.cores, "profile": str(args.profile)},
        "colocated_requests": sum(result.colocated),
        "node_seconds": result.node_seconds,
        "prefill_node_seconds": result.prefill_node_seconds,
        "decode_node_seconds": result.decode_node_seconds,
        "timeline": [{"t": p.t, "serving": dataclasses.asdict(p.serving), "alive": dataclasses.asdict(p.alive)}
                     for p in result.timeline],
    }
