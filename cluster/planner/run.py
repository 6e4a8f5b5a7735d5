"""Where the planner runs: inside `tandem serve --planner` (`embedded`), or on its own (`tandem planner`, `python -m
cluster.planner`) against a `tandem serve`'s admin API or a Helm release on Kubernetes (the chart's planner
Deployment runs `python -m cluster.planner --kubernetes ...`).

    python -m cluster.planner --profile node.json --slo-ttft-ms 500 --slo-itl-ms 50 \\
        --metrics-url http://proxy:8000/metrics [--resolve-all] \\
        (--admin-url URL --token T | --kubernetes --namespace NS --release R) \\
        [--interval-s 10] [--cooldown-s 60] [--min-prefill 1 --max-prefill 4 --min-decode 1 --max-decode 4] \\
        [--colocate-max-tokens 64] [--metrics-port 9400]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import shlex
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmark.profile import ProfileError, load_profile
from cluster.planner.loop import AdminScaler, KubernetesScaler, PlannerLoop, PlannerMetrics, PoolScaler, Scaler
from cluster.planner.policy import Planner, PolicyConfig
from cluster.planner.types import SLO, PoolSizes
from settings import env as environment

logger = logging.getLogger("cluster.planner")
DEFAULT_COLOCATE_MAX_TOKENS = 64  # the proxy's default (proxy/routing/router.py RouterConfig)


class PlannerSetupError(Exception):
    """A planner that cannot start (no profile, bad bounds); the message says why."""


def build_planner(profile_path: str, slo: SLO, cooldown_s: float, min_sizes: PoolSizes, max_sizes: PoolSizes,
                  colocate_max_tokens: int) -> Planner:
    try:
        profile = load_profile(Path(profile_path))
    except ProfileError as e:
        raise PlannerSetupError(f"the planner's profile: {e}") from None
    return Planner(profile, PolicyConfig(slo=slo, min_sizes=min_sizes, max_sizes=max_sizes, cooldown_s=cooldown_s,
                                         colocate_max_tokens=colocate_max_tokens))


def proxy_colocation(layout_threshold: int | None, proxy_args: str) -> int | None:
    """The proxy's --colocate-max-tokens as `tandem serve` starts it: --proxy-args' (it wins), else the layout's."""
    tokens = shlex.split(proxy_args)
    for i, token in enumerate(tokens):
        flag, _, value = token.partition("=")
        if flag == "--colocate-max-tokens":
            value = value or (tokens[i + 1] if i + 1 < len(tokens) else "")
            with contextlib.suppress(ValueError):
                layout_threshold = int(value)
    return layout_threshold


def embedded(settings: Any, pools: Any, wake: Callable[[], None], proxy_url: str,
             colocate_max_tokens: int | None) -> PlannerLoop:
    """The planner of `tandem serve --planner` (settings: settings.planner.PlannerSettings), on its pools."""
    planner = build_planner(
        settings.planner_profile, SLO(settings.slo_ttft_ms / 1000, settings.slo_itl_ms / 1000,
                                      settings.slo_percentile),
        settings.planner_cooldown_s, PoolSizes(settings.planner_min_prefill, settings.planner_min_decode),
        PoolSizes(settings.planner_max_prefill, settings.planner_max_decode),
        DEFAULT_COLOCATE_MAX_TOKENS if colocate_max_tokens is None else colocate_max_tokens)
    logger.info("planner: every %g s, TTFT p%g <= %g ms, ITL p%g <= %g ms, prefill %d..%d, decode %d..%d",
                settings.planner_interval_s, settings.slo_percentile, settings.slo_ttft_ms, settings.slo_percentile,
                settings.slo_itl_ms, settings.planner_min_prefill, settings.planner_max_prefill,
                settings.planner_min_decode, settings.planner_max_decode)
    return PlannerLoop(planner, PoolScaler(pools, wake), [proxy_url.rstrip("/") + "/metrics"],
                       settings.planner_interval_s)


def add_planner_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", required=True, help="the node profile (`tandem profile`)")
    parser.add_argument("--slo-ttft-ms", required=True, type=float)
    parser.add_argument("--slo-itl-ms", required=True, type=float)
    parser.add_argument("--slo-percentile", type=float, default=90.0)
    parser.add_argument("--metrics-url", action="append", required=True,
                        help="a proxy's /metrics (repeat for several proxies)")
    parser.add_argument("--resolve-all", action="store_true",
                        help="scrape every address the URLs' hosts resolve to (a headless Service: every proxy pod)")
    parser.add_argument("--interval-s", type=float, default=10.0)
    parser.add_argument("--cooldown-s", type=float, default=60.0)
    for role, low in (("prefill", 1), ("decode", 1)):
        parser.add_argument(f"--min-{role}", type=int, default=low)
        parser.add_argument(f"--max-{role}", type=int, default=4)
    parser.add_argument("--colocate-max-tokens", type=int, default=DEFAULT_COLOCATE_MAX_TOKENS,
                        help="the proxies' --colocate-max-tokens (the capacity model's colocation share)")
    parser.add_argument("--metrics-port", type=int, default=0, help="serve the planner's /metrics here (0: not)")
    parser.add_argument("--admin-url", default=environment.admin_url(), help="a `tandem serve`'s admin API")
    parser.add_argument("--token", default=environment.admin_token(), help="its admin token")
    parser.add_argument("--kubernetes", action="store_true", help="resize a Helm release's pools instead")
    parser.add_argument("--namespace", default="default")
    parser.add_argument("--release", default="tandem")
    parser.add_argument("--kubeconfig", default=None, help="default: the in-cluster service account")
    parser.add_argument("--log-level", default=environment.log_level())


def _scaler(args: argparse.Namespace) -> Scaler:
    if args.kubernetes:
        from cluster.kubernetes import KubernetesScaleError

        try:
            return KubernetesScaler(args.namespace, args.release, args.kubeconfig)
        except KubernetesScaleError as e:
            raise PlannerSetupError(str(e)) from None
    if not args.admin_url or not args.token:
        raise PlannerSetupError("give --admin-url and --token (a tandem serve's admin API), or --kubernetes")
    return AdminScaler(args.admin_url, args.token)


def run_planner(args: argparse.Namespace) -> int:
    """The standalone planner until SIGINT/SIGTERM; raises PlannerSetupError for what the user can fix."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    for role in ("prefill", "decode"):
        if not 0 <= getattr(args, f"min_{role}") <= getattr(args, f"max_{role}"):
            raise PlannerSetupError(f"--min-{role} must be within 0..--max-{role}")
    planner = build_planner(args.profile, SLO(args.slo_ttft_ms / 1000, args.slo_itl_ms / 1000, args.slo_percentile),
                            args.cooldown_s, PoolSizes(args.min_prefill, args.min_decode),
                            PoolSizes(args.max_prefill, args.max_decode), args.colocate_max_tokens)
    metrics = PlannerMetrics()
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, registry=metrics.registry)
    loop = PlannerLoop(planner, _scaler(args), args.metrics_url, args.interval_s, metrics, args.resolve_all)

    async def main() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await loop.run(stop)

    asyncio.run(main())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.planner", description=__doc__.split("\n\n")[0])
    add_planner_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_planner(args)
    except PlannerSetupError as e:
        print(f"planner: {e}")
        return 2
