"""`tandem profile`: measure a node on this hardware and write its profile (benchmark/profile.py).

    tandem profile [--model PATH] [--dtype D] [--node-threads N] [--max-num-batched-tokens N] [--max-num-seqs N]
                   [--prompt-lens 32,128,512,1024] [--decode-batches 1,4,16] [--no-handoff] [--quick] [-o FILE]
    tandem profile --base-url http://HOST:PORT [--tokenizer PATH] [--registry redis://...] ...

Without --base-url it runs `tandem serve` (its flags; a registry of its own) with a prefill and a decode node, and
measures, every request through the proxy with the bench client (fresh random prompts: no prefix hit; ignore_eos):
1. handoff, disaggregated: one request alone per prompt length, every prompt sent to P (--colocate-max-tokens 0);
2. the prefill node leaves (the admin API's scale): the same requests colocated on D; the handoff point is the
   difference of the second token's time (TTFT + first ITL);
3. prefill points: a batch of prompts sent at once, max_tokens 1: the median TTFT;
4. decode points: a batch of requests decoding together: the median ITL.
The node's capacity (KV blocks, step budget, batch size, block size) is what D publishes in the registry.
With --base-url it measures a running cluster's prefill and decode points (the handoff needs routing it chooses),
the capacity from --registry (that cluster's), else from the flags. Then `benchmark.profile.fit` and the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmark.datasets import PromptSynthesizer, prompt_synthesizer
from benchmark.profile import (
    HandoffPoint,
    NodeSpec,
    Points,
    Profile,
    ProfileError,
    fit,
    fit_errors,
    worst_relative_error,
)
from cluster.profile_points import DEFAULT_PLAN, QUICK_PLAN, Measurer, PointPlan, ProfileRunError, registry_capacity
from settings import TREE_KEYS, ConfigError, ServeConfig, add_arguments, resolve, to_args
from settings import env as environment
from settings.cluster import ENGINE_DEFAULTS
from wire.nodes import NodeCapacity

ROOT = Path(__file__).resolve().parents[1]

_POINT_FLAGS = (  # flag, PointPlan field, type, help
    ("--prompt-lens", "prompt_lens", "ints", "prefill points' prompt lengths"),
    ("--prefill-batches", "prefill_batches", "ints", "prefill points' prompts sent at once"),
    ("--decode-batches", "decode_batches", "ints", "decode points' requests at once"),
    ("--decode-prompt-len", "decode_prompt", "int", "decode points' prompt tokens"),
    ("--decode-output-len", "decode_output", "int", "decode points' output tokens (at least 2)"),
    ("--handoff-prompt-lens", "handoff_lens", "ints", "handoff points' prompt lengths"),
    ("--repeats", "repeats", "int", "runs per prefill and handoff point (their median counts)"),
    ("--point-tokens", "point_tokens", "int", "prompt tokens a point's runs send at most (fewer repeats; a larger "
                                              "prefill batch is left out)"))
NODE_FLAGS = ("--max-num-batched-tokens", "--max-num-seqs", "--num-kv-blocks")  # the node's, as in --node-args


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser, ServeConfig)  # the node is started as `tandem serve` would start it
    parser.add_argument("--log-level", default=environment.log_level("WARNING"))
    node = parser.add_argument_group("the node (flags of the node processes, as in --node-args)")
    for flag in NODE_FLAGS:
        node.add_argument(flag, type=_positive, default=None)
    points = parser.add_argument_group("the points (defaults: ~2 minutes of SmolLM2 on a CPU thread; --quick: seconds)")
    points.add_argument("--quick", action="store_true", help="a few small points (a smoke test, a rough fit)")
    for flag, dest, kind, text in _POINT_FLAGS:
        points.add_argument(flag, dest=dest, type=_ints if kind == "ints" else _positive, default=None, help=text)
    points.add_argument("--no-handoff", action="store_true", help="no handoff points (no prefill node is started)")
    points.add_argument("--seed", type=int, default=0, help="of the random prompts")
    target = parser.add_argument_group("measuring a running cluster")
    target.add_argument("--base-url", default=None, help="its proxy (instead of starting one); --registry, if "
                                                         "given, is its registry: the node's capacity comes from it")
    target.add_argument("--tokenizer", default=None, help="a model directory or tokenizer.json (default: --model)")
    out = parser.add_argument_group("output")
    out.add_argument("-o", "--output", type=Path, default=Path("profile.json"), help="the profile file to write")
    out.add_argument("--hardware", default=None, help="free text for the profile (default: this machine's CPU/GPU)")


def _positive(text: str) -> int:
    (value,) = _ints(text)
    return value


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"numbers separated by commas, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"positive numbers separated by commas, got {text!r}")
    return values


def plan_of(args: argparse.Namespace) -> PointPlan:
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(PointPlan)}
    plan = dataclasses.replace(QUICK_PLAN if args.quick else DEFAULT_PLAN,
                               **{k: v for k, v in given.items() if v is not None})
    if plan.decode_output < 2:
        raise ProfileRunError("--decode-output-len is at least 2 (an ITL needs two tokens)")
    return plan


def profile_main(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    import logging

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    command = shlex.join(["tandem", *(sys.argv[1:] if argv is None else argv)])
    try:
        config = resolve(ServeConfig, vars(args), environment.settings_layer(), TREE_KEYS)
        config = dataclasses.replace(config, node_args=_node_args(config.node_args, args))
        plan = plan_of(args)
        if args.base_url:
            profile = _profile_remote(args, config, plan)
        else:
            profile = _profile_local(args, config, plan)
        profile = dataclasses.replace(profile, command=command)
        _report(profile)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        profile.save(args.output)
    except (ProfileRunError, ProfileError, ConfigError) as e:
        print(f"tandem profile: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


def _node_args(node_args: str, args: argparse.Namespace) -> str:
    given = [(flag, getattr(args, flag[2:].replace("-", "_"))) for flag in NODE_FLAGS]
    return shlex.join([*shlex.split(node_args), *(x for flag, v in given if v is not None for x in (flag, str(v)))])


# ---- the cluster profile starts ----

@dataclass
class LocalCluster:
    url: str
    serve: Any  # cluster.serve.Child: the `tandem serve` process
    home: Path  # its TANDEM_CACHE_DIR: logs and state file (the admin API's address and token)
    registry_url: str

    def wait_for_nodes(self, prefill: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                r = httpx.get(f"{self.url}/health", timeout=2)
                if r.status_code == 200 and r.json()["ready_nodes"] == {"prefill": prefill, "decode": 1}:
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if self.serve.popen.poll() is not None:
                raise ProfileRunError(f"tandem serve exited with code {self.serve.popen.returncode}:\n"
                                      f"{self.serve.log_tail()}")
            if time.monotonic() > deadline:
                raise ProfileRunError(f"the cluster has not {prefill} prefill + 1 decode node after {timeout:.0f} s:"
                                      f"\n{self.serve.log_tail()}")
            time.sleep(0.2)

    def remove_prefill_node(self) -> None:
        from cluster.state import read_state

        state = read_state(self.home / "cluster.json")
        if state is None:
            raise ProfileRunError(f"tandem serve wrote no state file in {self.home}")
        r = httpx.post(f"{state.admin_url}/scale", json={"prefill": 0}, timeout=10,
                       headers={"Authorization": f"Bearer {state.token}"})
        if r.status_code >= 400:
            raise ProfileRunError(f"scaling the prefill pool to 0: {r.status_code} {r.text}")
        self.wait_for_nodes(prefill=0, timeout=60)


@contextmanager
def local_cluster(config: ServeConfig, prefill_nodes: int) -> Iterator[LocalCluster]:
    """`tandem serve` of `prefill_nodes` + 1 decode node on a free port, with a registry of its own (the node's
    capacity is read there) and a cache directory of its own (its state file must not replace a running
    cluster's), stopped on exit (SIGTERM: it stops its proxy, nodes and Ray itself)."""
    from cluster.pools import free_port
    from cluster.serve import Child, start_redis
    from cluster.state import cache_dir

    home = cache_dir() / "profile" / time.strftime(f"%Y%m%d-%H%M%S-{os.getpid()}")
    home.mkdir(parents=True, exist_ok=True)
    print(f"logs: {home}", file=sys.stderr, flush=True)
    children: list[Child] = []
    try:
        registry_url = start_redis(home, children)
        port = free_port("127.0.0.1")
        serve_config = dataclasses.replace(config, prefill_nodes=prefill_nodes, decode_nodes=1, host="127.0.0.1",
                                           port=port, registry=registry_url, admin_port=0,
                                           proxy_args=f"{config.proxy_args} --colocate-max-tokens 0".strip())
        env = {**os.environ, "TANDEM_CACHE_DIR": str(home),
               "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
        with (home / "serve.log").open("wb") as log:  # not Child.start: a `tandem serve` killed leaves Ray behind
            popen = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", *to_args(serve_config)],
                                     cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        children.append(Child("tandem serve", popen, home / "serve.log"))
        yield LocalCluster(f"http://127.0.0.1:{port}", children[-1], home, registry_url)
    finally:
        for child in reversed(children):
            child.stop(timeout=60)


def _profile_local(args: argparse.Namespace, config: ServeConfig, plan: PointPlan) -> Profile:
    from cluster.models import ModelChoiceError, resolve_model

    if config.registry is not None:
        raise ProfileRunError("--registry names a running cluster's registry: give --base-url too, or neither")
    try:
        model, served_name = resolve_model(config.model, config.served_model_name)
    except ModelChoiceError as e:
        raise ProfileRunError(str(e)) from None
    device = _device(config)
    threads = _threads(config) if device == "cpu" else 0
    config = dataclasses.replace(config, model=str(model), served_model_name=served_name,
                                 node_threads=threads or config.node_threads)
    handoff = not args.no_handoff
    with local_cluster(config, prefill_nodes=1 if handoff else 0) as cluster:
        synth = _synthesizer(model, args.seed)  # loads while the nodes do
        cluster.wait_for_nodes(prefill=1 if handoff else 0, timeout=config.startup_timeout + 60)
        measurer = Measurer(cluster.url, served_name, synth, config.api_key)
        capacity = registry_capacity(cluster.registry_url)
        disaggregated: dict[int, float] = {}
        if handoff:
            measurer.warm_up(max(plan.handoff_lens), "disaggregated")
            disaggregated = {n: measurer.second_token_s(n, plan.runs(n), "disaggregated") for n in plan.handoff_lens}
            print("the prefill node leaves: the decode node alone from here on", file=sys.stderr, flush=True)
            cluster.remove_prefill_node()
        measurer.warm_up(max(plan.prompt_lens + plan.handoff_lens), "colocated")
        points = measurer.node_points(plan)  # first: the prefill node's exit has settled by the handoff's turn
        handoff_points = tuple(HandoffPoint(n, s - measurer.second_token_s(n, plan.runs(n), "colocated"))
                               for n, s in disaggregated.items())
    if any(h.seconds < 0 for h in handoff_points):
        print("a handoff point is negative: the colocated request took longer than the disaggregated one (a busy "
              "machine?); the fit takes the line's non-negative part", file=sys.stderr)
    points = dataclasses.replace(points, handoff=handoff_points)
    node = _node_spec(served_name, config, device, threads, capacity)
    return _fitted(node, points, args, device)


def _profile_remote(args: argparse.Namespace, config: ServeConfig, plan: PointPlan) -> Profile:
    from benchmark.cli import BenchError, first_model

    base_url, tokenizer = args.base_url.rstrip("/"), args.tokenizer or config.model
    if tokenizer is None:
        raise ProfileRunError("--base-url needs --tokenizer (or --model): the model's directory or tokenizer.json")
    try:
        served_name = config.served_model_name or first_model(base_url, config.api_key)
    except BenchError as e:
        raise ProfileRunError(str(e)) from None
    measurer = Measurer(base_url, served_name, _synthesizer(Path(tokenizer), args.seed), config.api_key)
    if not args.no_handoff:
        print("no handoff points: they need a cluster whose routing tandem profile chooses (leave --base-url out)",
              file=sys.stderr)
    measurer.warm_up(max(plan.prompt_lens), None)
    points = measurer.node_points(plan)
    capacity = registry_capacity(config.registry) if config.registry else None
    if capacity is None:
        print("the node's capacity comes from the flags (--registry: the cluster's registry, where the nodes publish "
              "theirs)", file=sys.stderr)
        capacity = NodeCapacity(args.num_kv_blocks or 0, args.max_num_seqs or ENGINE_DEFAULTS["max_num_seqs"],
                                args.max_num_batched_tokens or ENGINE_DEFAULTS["max_num_batched_tokens"], 0)
    device = _device(config)
    return _fitted(_node_spec(served_name, config, device, config.node_threads or 0, capacity), points, args, device)


def _fitted(node: NodeSpec, points: Points, args: argparse.Namespace, device: str) -> Profile:
    step, request_s, handoff_base_s, handoff_per_token_s = fit(node, points)
    return Profile(node=node, step=step, request_s=request_s, handoff_base_s=handoff_base_s,
                   handoff_per_token_s=handoff_per_token_s, points=points, hardware=args.hardware or _hardware(),
                   cores=(os.cpu_count() or 0) if device == "cpu" else 0)


def _synthesizer(model: Path, seed: int) -> PromptSynthesizer:
    """benchmark.datasets.prompt_synthesizer; no tokenizer there is a ProfileRunError."""
    try:
        return prompt_synthesizer(model, seed)
    except ValueError as e:
        raise ProfileRunError(str(e)) from None


# ---- the node ----

def _node_spec(model: str, config: ServeConfig, device: str, threads: int, capacity: NodeCapacity | None
               ) -> NodeSpec:
    if capacity is None:
        raise ProfileRunError("the decode node published no record in the registry")
    return NodeSpec(model=model, dtype=config.cluster.dtype, device=device, threads=threads,
                    max_num_batched_tokens=capacity.max_num_batched_tokens, max_num_seqs=capacity.max_num_seqs,
                    block_size=capacity.block_size or config.cluster.hashing.block_size,
                    num_kv_blocks=capacity.total_kv_blocks)


def _device(config: ServeConfig) -> str:
    """Where `tandem serve` puts the nodes: on the GPUs when there are any (and --node-gpus is not 0)."""
    if config.node_gpus == 0:
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _threads(config: ServeConfig) -> int:
    """The decode node's torch threads: --node-threads, else what `tandem serve` gives a lone decode node."""
    if config.node_threads is not None:
        return config.node_threads
    from cluster.layout import serve_layout

    return serve_layout(dataclasses.replace(config, prefill_nodes=0, decode_nodes=1), os.cpu_count() or 1
                        ).decode_threads


def _hardware() -> str:
    """This machine's CPU model and cores, and its GPUs."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")]
    text = f"{names[0] if names else platform.machine()}, {os.cpu_count()} cores"
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return text + (f"; {torch.cuda.get_device_name(0)} x{gpus}" if gpus else "")


def _report(profile: Profile) -> None:
    s = profile.step
    print(f"\nstep_s = {s.base_s * 1e3:.3f} ms + {s.per_token_s * 1e6:.2f} us/token + {s.per_seq_s * 1e6:.2f} us/seq "
          f"+ {s.per_attended_s * 1e3:.3f} ms/M attention pairs;  request {profile.request_s * 1e3:.2f} ms;  "
          f"handoff {profile.handoff_base_s * 1e3:.2f} ms + {profile.handoff_per_token_s * 1e6:.2f} us/token")
    errors = fit_errors(profile)
    print(f"{'point':<36} {'measured ms':>11} {'fitted ms':>10} {'error':>7}")
    for name, measured, fitted in errors:
        print(f"{name:<36} {measured * 1e3:>11.2f} {fitted * 1e3:>10.2f} {(fitted - measured) / measured:>+7.1%}")
    for h in profile.points.handoff:
        print(f"{f'handoff L={h.prompt_tokens}':<36} {h.seconds * 1e3:>11.2f} "
              f"{profile.handoff_s(h.prompt_tokens) * 1e3:>10.2f}")
    print(f"worst relative error (prefill, decode): {worst_relative_error(errors):.1%}")

