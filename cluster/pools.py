"""The prefill and decode pools on Ray: each node is a placement group of TP bundles and an actor in it that owns
the node's process (`python -m prefill_node` / `decode_node`).

A node's life:
1. STARTING: its placement group is created and must be placed within the startup timeout (Ray waits forever
   for resources that never come, so every wait here has a timeout); the actor starts the process, which
   prints READY when it serves and then registers itself in the registry.
2. READY (serving and registered: the proxy can find it): counted in the pool's `ready`. A process that exits
   on its own makes the node FAILED; the pool replaces it.
3. DRAINING (scale-down): the actor sends SIGTERM; the node marks itself draining in the registry (the proxy
   stops choosing it), finishes its requests, deregisters and exits (node_common/server.py); then the actor
   and the placement group go. At shutdown nodes stop at once instead (a second SIGTERM skips the wait).

`PoolManager.reconcile` moves each pool towards its desired size; it runs every half second in `tandem serve`.

Where a node goes on a Ray cluster of several machines (`Placement`): PACK leaves it to Ray; SPREAD chooses the
machine itself (`spread_host`) and pins the node's placement group there with Ray's built-in per-machine resource
`node:<ip>`. A node of a role with custom resources (--prefill-resources) asks for them in its first bundle, so Ray
puts it only on machines started with them. Either way a node listens on, and advertises, its machine's address.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import enum
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import ray
import redis.asyncio as aioredis
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from redis.exceptions import RedisError

from cluster.rank_placement import reserve_rank_gpus
from settings import ClusterSettings, to_args
from settings.env import child_environment
from wire import node_key

logger = logging.getLogger(__name__)
T = TypeVar("T")

ROLES = ("prefill", "decode")
_RAY_CALL_TIMEOUT_S = 30.0
FAILURE_BACKOFF_S = 5.0


class Placement(enum.Enum):
    """Where nodes go on a Ray cluster of several machines."""

    PACK = "pack"  # Ray's choice: its default policy fills a machine before the next
    SPREAD = "spread"  # `spread_host`: the least-loaded machine with room, apart from the other role's nodes


class NodeState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


@dataclass(frozen=True)
class NodeLaunch:
    """What every node of the cluster runs with (the role and the id vary per node)."""

    model: str
    registry_url: str
    cluster: ClusterSettings = field(default_factory=ClusterSettings)  # handed to every node as flags
    environment: Mapping[str, str] = field(default_factory=dict)  # transport variables the processes start with
    tp: int = 1
    role_tp: Mapping[str, int] = field(default_factory=dict)  # a role's own TP size (--prefill-tp, --decode-tp)
    cpus_per_node: float = 0.5
    gpus_per_rank: float = 0.0  # 0: the nodes run on CPU; a fraction: nodes share a GPU (Ray packs them)
    gpu_memory_utilization: float | None = None  # what each node on a GPU takes of its memory (None: its default)
    bind_loopback: bool = True  # a single-machine cluster: nodes listen on 127.0.0.1 only
    # torch CPU threads of each role's node processes (cluster/layout.py); a role not named keeps torch's default
    # (under Ray: OMP_NUM_THREADS, which Ray sets to the actor's whole CPUs, at least 1)
    num_threads: Mapping[str, int] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    log_dir: str | None = None
    placement: Placement = Placement.PACK
    # Ray custom resources each node of a role takes (--prefill-resources, --decode-resources)
    role_resources: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def tp_of(self, role: str) -> int:
        return self.role_tp.get(role, self.tp)

    def bundles_of(self, role: str) -> list[dict[str, float]]:
        """The placement group of a node of `role`; its custom resources go in the first bundle (the actor's)."""
        bundles = placement_bundles(self.tp_of(role), self.gpus_per_rank, self.cpus_per_node)
        bundles[0].update(self.role_resources.get(role, {}))
        return bundles


def placement_bundles(tp: int, gpus_per_rank: float, cpus_per_node: float) -> list[dict[str, float]]:
    """One bundle per tensor-parallel rank, each with a share of the node's CPUs and, on GPU machines, its GPU (or
    a fraction of one: Ray packs fractional bundles onto one GPU until it is full)."""
    cpus = {"CPU": cpus_per_node / tp}
    return [{**cpus, "GPU": gpus_per_rank} if gpus_per_rank > 0 else cpus for _ in range(tp)]


def spread_host(role: str, need: Mapping[str, float], hosts: Mapping[str, Mapping[str, float]],
                placed: Sequence[tuple[str, str, Mapping[str, float]]]) -> str | None:
    """The machine (its IP) for a new node of `role` that takes `need` in all, or None to leave it to Ray (one
    machine, or none with room).

    `hosts`: each machine's total resources; `placed`: (host, role, what it takes) of the nodes already there. A
    machine has room if its totals less what our nodes hold there cover `need` (others' use of Ray is not seen: a
    machine they fill makes the node wait for room, then fail and be retried). Among those: machines without nodes
    of the other role first (prefill and decode apart, so neither's steps slow the other's), then the fewest nodes,
    then the most room."""
    if len(hosts) < 2:
        return None

    def free(host: str) -> dict[str, float]:
        left = dict(hosts[host])
        for where, _, taken in placed:
            if where == host:
                for name, amount in taken.items():
                    left[name] = left.get(name, 0.0) - amount
        return left

    def score(host: str) -> tuple[bool, int, float, str]:
        roles = [r for where, r, _ in placed if where == host]
        return any(r != role for r in roles), len(roles), -free(host).get("CPU", 0.0), host

    room = [h for h in hosts if all(free(h).get(name, 0.0) >= amount - 1e-9 for name, amount in need.items())]
    return min(room, key=score) if room else None


def ray_hosts() -> dict[str, dict[str, float]]:
    """The live machines of the Ray cluster by IP (Ray nodes sharing one IP summed) and their total resources."""
    hosts: dict[str, dict[str, float]] = {}
    for ray_node in ray.nodes():
        if ray_node.get("Alive"):
            totals = hosts.setdefault(ray_node["NodeManagerAddress"], {})
            for name, amount in ray_node.get("Resources", {}).items():
                if not name.startswith("node:"):
                    totals[name] = totals.get(name, 0.0) + float(amount)
    return hosts


def node_command(launch: NodeLaunch, role: str, node_id: str, host: str, port: int) -> list[str]:
    return [sys.executable, "-m", f"{role}_node", "--model", launch.model, *to_args(launch.cluster),
            "--host", host, "--port", str(port), "--node-id", node_id, "--registry", launch.registry_url,
            *device_args(launch), *thread_args(launch, role), *tp_args(launch, role), *launch.extra_args]


def tp_args(launch: NodeLaunch, role: str) -> list[str]:
    tp = launch.tp_of(role)
    return ["--tensor-parallel-size", str(tp)] if tp > 1 else []


def thread_args(launch: NodeLaunch, role: str) -> list[str]:
    """Before the extra args, so that a `--num-threads` in --node-args wins."""
    num_threads = launch.num_threads.get(role)
    return [] if num_threads is None else ["--num-threads", str(num_threads)]


def device_args(launch: NodeLaunch) -> list[str]:
    """A node placed with a GPU runs on it (Ray shows it the GPU alone: it is its cuda); a node placed without one
    runs on CPU even on a GPU machine, never on a GPU another node was given."""
    if launch.gpus_per_rank <= 0:
        return ["--device", "cpu"]
    share = [] if launch.gpu_memory_utilization is None else [
        "--gpu-memory-utilization", str(launch.gpu_memory_utilization)]
    return ["--device", "cuda", *share]


def node_environment(launch: NodeLaunch, gpu_ids: Sequence[int | str] = ()) -> dict[str, str]:
    """The node process's environment: the actor's, plus the transport variables the launch names (nothing
    forced: UCX on a real cluster keeps its InfiniBand modules), and the GPUs Ray gave the node's actor, named
    here rather than left to whether Ray exported them in the actor's own environment."""
    gpus = {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in gpu_ids)} if gpu_ids else {}
    return child_environment({**launch.environment, **gpus})


class NodeProcess:
    """Runs inside the node's Ray actor: starts the node's process and reports on it.

    Every method returns at once (the driver polls), so the actor's single thread is never blocked. The process
    dies with the actor (PR_SET_PDEATHSIG), even when Ray kills the actor outright.
    """

    def __init__(self, launch: NodeLaunch, role: str, node_id: str, rank_gpu_ids: Sequence[str] = ()) -> None:
        """rank_gpu_ids: the GPUs of the node's other tensor-parallel ranks (cluster/rank_placement.py)."""
        self.launch = launch
        self.role = role
        self.node_id = node_id
        self.rank_gpu_ids = list(rank_gpu_ids)
        self.popen: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None

    def start(self) -> str:
        """Starts the process; returns the address it will serve on."""
        host = "127.0.0.1" if self.launch.bind_loopback else ray.util.get_node_ip_address()
        port = free_port(host)
        log_dir = Path(self.launch.log_dir) if self.launch.log_dir else Path.cwd()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{self.node_id}.log"
        with self.log_path.open("wb") as log:
            self.popen = subprocess.Popen(node_command(self.launch, self.role, self.node_id, host, port),
                                          stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=self.environment(), start_new_session=True,
                                          preexec_fn=die_with_parent)
        return f"{host}:{port}"

    def environment(self) -> dict[str, str]:
        """The node process's environment, with the GPUs Ray gave this actor (none on CPU placements)."""
        gpus = [*ray.get_gpu_ids(), *self.rank_gpu_ids] if self.launch.gpus_per_rank > 0 else []
        return node_environment(self.launch, gpus)

    def state(self) -> tuple[str, int | None]:
        """("starting" | "ready" | "exited", exit code)."""
        if self.popen is None:
            return "exited", None  # never started
        code = self.popen.poll()
        if code is not None:
            return "exited", code
        return ("ready" if b"READY " in self._read_log() else "starting"), None

    def terminate(self, force: bool = False) -> None:
        """SIGTERM starts the node's drain; `force` sends a second one (stop without waiting)."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            if force:
                time.sleep(0.05)  # two signals in one instant may be seen as one
                self.popen.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()

    def log_tail(self, num_bytes: int = 4000) -> str:
        return self._read_log()[-num_bytes:].decode(errors="replace")

    def _read_log(self) -> bytes:
        return self.log_path.read_bytes() if self.log_path is not None and self.log_path.exists() else b""


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the actor process dies (Linux; elsewhere a no-op)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


@dataclass(eq=False)
class Node:
    node_id: str
    role: str
    state: NodeState = NodeState.STARTING
    address: str | None = None
    placement: PlacementGroup | None = None
    actor: Any = None  # the NodeProcess actor handle
    rank_holders: list[Any] = field(default_factory=list)  # a TP node's other ranks' GPU reservations
    error: str | None = None
    host: str | None = None  # the machine's IP: where SPREAD pinned it, else where it started serving
    taken: Mapping[str, float] = field(default_factory=dict)  # what its placement group holds there, in all
    started_at: float = field(default_factory=time.monotonic)
    task: asyncio.Task[None] | None = None  # what the manager is doing with it (start, drain)


@dataclass(frozen=True)
class PoolStatus:
    desired: int
    ready: int
    starting: int
    draining: int


class PoolManager:
    """The prefill and decode pools: desired sizes, the nodes, and the reconcile step that joins them."""

    def __init__(self, launch: NodeLaunch, desired: dict[str, int], startup_timeout_s: float = 300.0,
                 resources: Callable[[], Mapping[str, float]] | None = None,
                 hosts: Callable[[], Mapping[str, Mapping[str, float]]] = ray_hosts) -> None:
        """`resources`: what the cluster has to place nodes on (default: Ray's, once Ray is up); `hosts`: its
        machines and their totals, for SPREAD."""
        assert set(desired) == set(ROLES), f"desired sizes for {ROLES}, got {sorted(desired)}"
        self.launch = launch
        self.desired = dict(desired)
        self.startup_timeout_s = startup_timeout_s
        # the node drains for --drain-timeout (the same setting); the pool waits a margin more before killing it
        self.drain_timeout_s = launch.cluster.drain_timeout
        self._resources = resources or (lambda: ray.cluster_resources() if ray.is_initialized() else {})
        self._hosts = hosts
        self.nodes: list[Node] = []
        self._ids = itertools.count()
        self._actor_class = ray.remote(max_restarts=0)(NodeProcess)
        self._last_health_check = 0.0
        self._last_start_failure: dict[str, float] = {}
        self._redis = aioredis.Redis.from_url(launch.registry_url, socket_timeout=5.0, socket_connect_timeout=2.0)

    # ---- what the admin API sees ----
    def scale(self, sizes: dict[str, int]) -> None:
        """Sets desired sizes. Raises ValueError for a bad size, or for more nodes than this machine can place
        (a single-machine cluster cannot grow; a multi-machine one may, through Ray's autoscaler)."""
        for role, size in sizes.items():
            if role not in ROLES or size < 0:
                raise ValueError(f"pool sizes must be non-negative counts of {ROLES}, got {role}={size}")
        total = sum({**self.desired, **sizes}.values())
        room = self.room()
        if self.launch.bind_loopback and room is not None and total > room:
            raise ValueError(f"{total} nodes do not fit on this machine: it has room for {room} "
                             f"({self._per_node()} each); ask for fewer, or start with a smaller "
                             f"{'--node-gpus' if self.launch.gpus_per_rank > 0 else '--node-cpus'}")
        self.desired.update(sizes)
        logger.info("desired pool sizes: %s", self.desired)

    def room(self) -> int | None:
        """How many nodes the cluster's resources hold in all (None while it has none: Ray is not up)."""
        resources = self._resources()
        if not resources:
            return None
        tp = max(self.launch.tp_of(role) for role in ROLES)
        bundles = placement_bundles(tp, self.launch.gpus_per_rank, self.launch.cpus_per_node)
        need = {name: sum(b.get(name, 0.0) for b in bundles) for name in ("CPU", "GPU")}
        return min(int(resources.get(name, 0.0) // amount) for name, amount in need.items() if amount > 0)

    def _per_node(self) -> str:
        cpus = f"{self.launch.cpus_per_node:g} CPU"
        if self.launch.gpus_per_rank > 0:
            return f"{max(self.launch.tp_of(r) for r in ROLES) * self.launch.gpus_per_rank:g} GPU and {cpus}"
        return cpus

    def status(self) -> dict[str, PoolStatus]:
        def count(role: str, state: NodeState) -> int:
            return sum(1 for n in self.nodes if n.role == role and n.state is state)

        return {role: PoolStatus(self.desired[role], count(role, NodeState.READY), count(role, NodeState.STARTING),
                                 count(role, NodeState.DRAINING)) for role in ROLES}

    def all_ready(self) -> bool:
        return all(s.ready == s.desired and s.starting == 0 for s in self.status().values())

    # ---- the control loop ----
    async def reconcile(self) -> None:
        """One step: start or drain nodes so each pool heads to its desired size; replace failed nodes."""
        if time.monotonic() - self._last_health_check > 2.0:
            self._last_health_check = time.monotonic()
            await self._check_health()
        for node in [n for n in self.nodes if n.state is NodeState.FAILED and n.task is None]:
            node.task = asyncio.create_task(self._remove(node, drain=False))
        for role in ROLES:
            live = [n for n in self.nodes if n.role == role and n.state in (NodeState.STARTING, NodeState.READY)]
            # a node that cannot start (a bad flag, no memory) is retried, but not in a tight loop
            backing_off = time.monotonic() - self._last_start_failure.get(role, -1e9) < FAILURE_BACKOFF_S
            for _ in range(0 if backing_off else self.desired[role] - len(live)):
                node = Node(f"{role}-{next(self._ids)}", role)
                self.nodes.append(node)
                node.task = asyncio.create_task(self._start(node))
            # the newest go first: starting nodes (no traffic yet), then the most recently started
            surplus = sorted(live, key=lambda n: (n.state is NodeState.READY, -n.started_at))
            for node in surplus[:max(0, len(live) - self.desired[role])]:
                if node.task is not None:
                    node.task.cancel()  # a start in progress
                node.state = NodeState.DRAINING
                node.task = asyncio.create_task(self._remove(node, drain=True))

    async def shutdown(self) -> None:
        """Stops every node at once, without draining (the proxy is already gone)."""
        for node in self.nodes:
            if node.task is not None:
                node.task.cancel()
        await asyncio.gather(*(self._remove(n, drain=False) for n in list(self.nodes)), return_exceptions=True)
        await self._redis.aclose()

    async def _start(self, node: Node) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            await self.place(node, deadline - time.monotonic())
            address: str = await _ray_wait(node.actor.start.remote(), deadline - time.monotonic(),
                                           f"the actor of {node.node_id} did not start")
            node.address, node.host = address, address.rpartition(":")[0]  # where Ray put it (SPREAD chose it)
            while True:
                state, code = await _ray_wait(node.actor.state.remote(), _RAY_CALL_TIMEOUT_S, "actor unresponsive")
                if state == "ready" and await self._registered(node):
                    break  # serving, and the proxy can find it
                if state == "exited":
                    tail = await _ray_wait(node.actor.log_tail.remote(), _RAY_CALL_TIMEOUT_S, "actor unresponsive")
                    raise RuntimeError(f"exited with code {code} while starting:\n{tail}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not serving after {self.startup_timeout_s:.0f} s")
                await asyncio.sleep(0.2)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure to start makes the node FAILED, to be replaced
            logger.error("node %s failed to start: %s", node.node_id, e)
            self._last_start_failure[node.role] = time.monotonic()
            node.error = str(e)
            node.state = NodeState.FAILED
        else:
            logger.info("node %s ready on %s", node.node_id, node.address)
            node.state = NodeState.READY
        finally:
            if node.state is not NodeState.DRAINING:
                node.task = None

    async def place(self, node: Node, timeout_s: float) -> None:
        """Reserves the node's placement group and creates its actor in it (the process is not started yet).
        The actor asks for its bundle's GPU share, so Ray shows it the GPU it reserved."""
        bundles = self.launch.bundles_of(node.role)
        node.taken = {name: sum(b.get(name, 0.0) for b in bundles) for name in {n for b in bundles for n in b}}
        if self.launch.placement is Placement.SPREAD:
            placed = [(n.host, n.role, n.taken) for n in self.nodes if n is not node and n.host is not None]
            node.host = spread_host(node.role, node.taken, self._hosts(), placed)
            if node.host is not None:  # Ray's own resource of that machine: a sliver pins the group there
                bundles[0][f"node:{node.host}"] = 0.001
            else:
                logger.info("placing %s: no machine to spread it to (one machine, or none with room): Ray chooses",
                            node.node_id)
        # one machine for all of a node's ranks (a bundle each): they talk over NCCL / gloo on loopback
        node.placement = placement_group(bundles, strategy="STRICT_PACK", name=f"tandem-{node.node_id}")
        await _ray_wait(node.placement.ready(), timeout_s,
                        f"no room to place {node.node_id} ({bundles}): not enough free resources")
        node.rank_holders, rank_gpu_ids = await reserve_rank_gpus(node.placement, bundles, timeout_s)
        node.actor = self._actor_class.options(
            num_cpus=bundles[0]["CPU"], num_gpus=bundles[0].get("GPU", 0.0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(node.placement, placement_group_bundle_index=0),
        ).remote(self.launch, node.role, node.node_id, rank_gpu_ids)

    async def _registered(self, node: Node) -> bool:
        try:
            return bool(await self._redis.exists(node_key(node.node_id)))
        except (RedisError, OSError) as e:
            logger.warning("cannot read the registry: %r", e)
            return False

    async def _check_health(self) -> None:
        for node in [n for n in self.nodes if n.state is NodeState.READY]:
            try:
                state, code = await _ray_wait(node.actor.state.remote(), _RAY_CALL_TIMEOUT_S, "actor unresponsive")
            except Exception as e:  # noqa: BLE001 - a dead actor is a failed node
                state, code = "exited", None
                node.error = str(e)
            if state == "exited" and node.state is NodeState.READY:
                logger.error("node %s exited (code %s); replacing it", node.node_id, code)
                node.state = NodeState.FAILED

    async def _remove(self, node: Node, drain: bool) -> None:
        """Drains (or stops at once) the node's process, then frees its actor and placement group."""
        try:
            if node.actor is not None:
                await _ray_wait(node.actor.terminate.remote(not drain), _RAY_CALL_TIMEOUT_S, "actor unresponsive")
                deadline = time.monotonic() + (self.drain_timeout_s + 15.0 if drain else 10.0)
                while time.monotonic() < deadline:
                    state, _ = await _ray_wait(node.actor.state.remote(), _RAY_CALL_TIMEOUT_S, "actor unresponsive")
                    if state == "exited":
                        break
                    await asyncio.sleep(0.2)
                else:
                    logger.warning("node %s did not exit in time: killing it", node.node_id)
                    await _ray_wait(node.actor.kill.remote(), _RAY_CALL_TIMEOUT_S, "actor unresponsive")
                logger.info("node %s %s", node.node_id, "drained and stopped" if drain else "stopped")
        except Exception as e:  # noqa: BLE001 - whatever happened, the actor and placement group still go
            logger.warning("stopping node %s: %s", node.node_id, e)
        finally:
            actor, node.actor = node.actor, None  # freed once, whoever gets here first (drain or shutdown)
            placement, node.placement = node.placement, None
            with contextlib.suppress(Exception):  # Ray itself may be going away
                for holder in [actor, *node.rank_holders]:
                    if holder is not None:
                        ray.kill(holder)
                node.rank_holders = []
                if placement is not None:
                    remove_placement_group(placement)
            if node in self.nodes:
                self.nodes.remove(node)


async def _ray_wait(ref: Awaitable[T], timeout: float, what: str) -> T:
    try:
        return await asyncio.wait_for(ref, timeout=max(timeout, 0.1))
    except TimeoutError:
        raise TimeoutError(what) from None
