"""`tandem`: serve a cluster, and look at or resize a running one.

    tandem serve [--model PATH] [--prefill-nodes N] [--decode-nodes M] ... [--config FILE]
    tandem status [--json]
    tandem scale [--prefill N] [--decode M] [--kubernetes --namespace NS --release R]
    tandem bench serve|compare|plot ...    (benchmark/cli.py)
    tandem plan --profile FILE --slo-ttft-ms MS --slo-itl-ms MS --request-rate R ...    (cluster/planner/plan.py)
    tandem planner --profile FILE ... (--admin-url URL | --kubernetes)    (cluster/planner/run.py)
    tandem profile [--model PATH] [--quick] [-o FILE] ...    (cluster/profile_cli.py)

`status` and `scale` talk to the admin API of the cluster `tandem serve` runs on this machine (its address and
token are in the state file, see cluster/state.py); --admin-url and --token (or TANDEM_ADMIN_URL and
TANDEM_ADMIN_TOKEN) reach another one. `scale --kubernetes` resizes a Helm release's pools instead
(cluster/kubernetes.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

import httpx

from benchmark.cli import BenchError, add_bench_commands
from cluster.planner.plan import PlanError, add_plan_arguments, run_plan
from cluster.planner.run import PlannerSetupError, add_planner_arguments, run_planner
from cluster.profile_cli import add_profile_arguments
from cluster.state import read_state, state_path
from settings import TREE_KEYS, ConfigError, ServeConfig, add_arguments, resolve
from settings import env as environment


class CLIError(Exception):
    """Something the user can fix; printed without a traceback."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated prefill/decode LLM serving.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="run a cluster: proxy, prefill and decode pools on Ray",
                                       description="Settings: CLI flag > YAML --config > TANDEM_* env > default.")
    add_arguments(serve_parser, ServeConfig)
    serve_parser.add_argument("--log-level", default=environment.log_level())
    status_parser = commands.add_parser("status", help="pool sizes of the running cluster")
    status_parser.add_argument("--json", action="store_true", help="print the admin API's JSON")
    scale_parser = commands.add_parser("scale", help="resize the pools (removed nodes drain first)")
    scale_parser.add_argument("--prefill", type=_pool_size, default=None,
                              help="desired prefill nodes (with --kubernetes, `auto` hands the pool back to KEDA)")
    scale_parser.add_argument("--decode", type=_pool_size, default=None, help="desired decode nodes (or `auto`)")
    kubernetes = scale_parser.add_argument_group("Kubernetes (a release of deploy/helm/tandem)")
    kubernetes.add_argument("--kubernetes", action="store_true",
                            help="resize the pools of a Helm release on Kubernetes instead of a local cluster")
    kubernetes.add_argument("--namespace", default="default", help="the release's namespace")
    kubernetes.add_argument("--release", default="tandem", help="the Helm release's name")
    kubernetes.add_argument("--kubeconfig", default=None, help="default: $KUBECONFIG or ~/.kube/config, else the "
                                                                "in-cluster service account")
    kubernetes.add_argument("--context", default=None, help="the kubeconfig context (default: its current one)")
    for sub in (status_parser, scale_parser):
        sub.add_argument("--admin-url", default=environment.admin_url(),
                         help="admin API of a remote cluster (default: the local one's, from its state file)")
        sub.add_argument("--token", default=environment.admin_token(), help="its admin token")
    add_bench_commands(commands.add_parser("bench", help="serving benchmark over the OpenAI API (vLLM's metrics)"))
    add_plan_arguments(commands.add_parser("plan", help="how many prefill and decode nodes a load needs under SLOs"))
    add_planner_arguments(commands.add_parser("planner", help="size a cluster's pools from its load, continuously"))
    add_profile_arguments(commands.add_parser("profile", help="measure a node on this hardware: its profile file",
                                              description="Flags as tandem serve's; see cluster/profile_cli.py."))
    args = parser.parse_args(argv)
    try:
        if args.command == "bench":
            return int(args.bench_main(args))
        if args.command == "serve":
            return _serve(args)
        if args.command == "plan":
            return run_plan(args)
        if args.command == "planner":
            return run_planner(args)
        if args.command == "profile":
            from cluster.profile_cli import profile_main

            return profile_main(args, argv)
        if args.command == "status":
            return _status(args)
        return _scale(args)
    except (CLIError, ConfigError, BenchError, PlanError, PlannerSetupError) as e:
        print(f"tandem {args.command}: {e}", file=sys.stderr)
        return 2


def _serve(args: argparse.Namespace) -> int:
    from cluster.serve import ServeError, serve  # Ray and friends load only for this command

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health poll otherwise
    config = resolve(ServeConfig, vars(args), environment.settings_layer(), TREE_KEYS)
    try:
        serve(config)
    except ServeError as e:
        raise CLIError(str(e)) from None
    except KeyboardInterrupt:
        return 130  # stopped while starting; what had started is stopped again
    return 0


def _status(args: argparse.Namespace) -> int:
    body = _admin(args, "GET", "/status")
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    if body.get("proxy_url"):
        print(f"proxy: {body['proxy_url']}  model: {body.get('model', '?')}")
    print(f"{'pool':<8} {'desired':>7} {'ready':>5} {'starting':>8} {'draining':>8}")
    for role, pool in body["pools"].items():
        print(f"{role:<8} {pool['desired']:>7} {pool['ready']:>5} {pool.get('starting', 0):>8} "
              f"{pool.get('draining', 0):>8}")
    return 0


def _pool_size(text: str) -> int | str:
    if text == AUTO:
        return text
    try:
        size = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of nodes or {AUTO!r}, got {text!r}") from None
    if size < 0:
        raise argparse.ArgumentTypeError(f"a number of nodes is at least 0, got {size}")
    return size


AUTO = "auto"


def _scale(args: argparse.Namespace) -> int:
    sizes = {role: size for role, size in (("prefill", args.prefill), ("decode", args.decode)) if size is not None}
    if not sizes:
        raise CLIError("give --prefill N and/or --decode M")
    if args.kubernetes:
        return _scale_kubernetes(args, sizes)
    if AUTO in sizes.values():
        raise CLIError("`auto` (hand the pool back to KEDA) needs --kubernetes")
    body = _admin(args, "POST", "/scale", sizes)
    pools = body["pools"]
    print(", ".join(f"{role}: {pools[role]['ready']} ready, {pools[role]['desired']} desired" for role in pools)
          + "  (see `tandem status`)")
    return 0


def _scale_kubernetes(args: argparse.Namespace, sizes: dict[str, int | str]) -> int:
    from cluster.kubernetes import KubernetesPools, KubernetesScaleError

    try:
        pools = KubernetesPools(args.namespace, args.release, kubeconfig=args.kubeconfig, context=args.context)
        for role, size in sizes.items():
            print(pools.scale(role, None if size == AUTO else int(size)).describe())
    except KubernetesScaleError as e:
        raise CLIError(str(e)) from None
    return 0


def _admin(args: argparse.Namespace, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    url, token = args.admin_url, args.token
    if url is None:
        state = read_state()
        if state is None:
            raise CLIError(f"no local cluster ({state_path()} does not exist): start one with `tandem serve`, "
                           f"or pass --admin-url and --token")
        if not _alive(state.pid):
            raise CLIError(f"no local cluster: {state_path()} is left over from process {state.pid}, which is gone")
        url, token = state.admin_url, token or state.token
    if not token:
        raise CLIError("--token (or TANDEM_ADMIN_TOKEN) is needed with --admin-url")
    try:
        r = httpx.request(method, url.rstrip("/") + path, json=body, timeout=10,
                          headers={"Authorization": f"Bearer {token}"})
    except httpx.HTTPError as e:
        raise CLIError(f"cannot reach the admin API at {url}: {e} (is `tandem serve` still running?)") from None
    if r.status_code >= 400:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text
        raise CLIError(f"{r.status_code}: {message}")
    return r.json()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


if __name__ == "__main__":
    sys.exit(main())
