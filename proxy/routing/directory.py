"""The proxy's directory: its live table of nodes (read from the registry or polled), and the prefix index
their KV events feed. It only reads the registry; nodes write it (node_common/registrar.py).

Two sources, combinable:
- static addresses (`--prefill/--decode HOST:PORT`, single-machine use): polled every `health_interval_s` with
  Health (liveness) and Stats (load; a busy node's Stats waits for its engine step, so a late answer keeps the
  last load and is no failure). A node is healthy after a good Health check and unhealthy after
  FAILED_CHECKS_TO_LOSE failed ones in a row (proxy.routing.liveness); when every listed node of a role is unhealthy
  they are all offered anyway (the operator named them: trying one that just restarted beats refusing the
  request).
- the registry (`--registry redis://...`): every `poll_s` the node keys (wire.registry) written by node registrars
  are scanned. A key that is gone (its TTL ran out, or the node deregistered) is a node gone, from routing
  and from the prefix index. A node both listed and registered is one node, described by its registration.
  A registry that restarted empty (its run id changed) lost the keys of nodes that are still serving: for
  REGISTRY_RESTART_GRACE_S the nodes of the last table stay while they register again (each does on its next
  heartbeat), rather than all leaving routing at once (a dead one among them still fails over on use).
Either way, a node a call just found unreachable is left out of routing for a short back-off (proxy.routing.dead_nodes),
before its registry entry expires or its polls fail, even when it is the last node of its role.

Requests in flight: a registered node with attempts in flight is health-checked too, on the same rule as a static
one. A node that fails the checks, or that a call finds unreachable, is lost (proxy.routing.liveness): the attempts in
flight there are abandoned and retried elsewhere (proxy.routing.attempts) rather than left to wait for it.

KV events: one task reads the cluster's stream from where it left off and applies each node's delta to the
index, in the delta's tier: a node's device and host tiers are its own; its store deltas go to the store of its KV
layout, stamped with the entry's time. A node first seen, restarted (seq 0) or with a gap in its seq gets its
sets reloaded, and the store set of its layout with them (the entries it missed may have added to it; a store
set only adds, so reading it again is harmless); a lock keeps a delta from being applied while a reload awaits
Redis (the snapshot would overwrite it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from node_common.tls import PLAINTEXT, ChannelSecurity
from proxy.routing.clients import DecodeClient, NodeClient, NodeHealth, PrefillClient
from proxy.routing.dead_nodes import DeadNodes
from proxy.routing.liveness import Liveness, check_failure
from proxy.routing.prefix_index import NODE_TIERS, PrefixIndex
from wire import (
    KV_EVENTS_STREAM,
    NODE_KEY_PATTERN,
    KVDelta,
    NodeCapacity,
    NodeLoad,
    NodeRecord,
    NodeStats,
    Role,
    hash_fingerprint,
    kv_set_key,
)
from wire.registry import Tier, store_set_key

logger = logging.getLogger(__name__)

REGISTRY_RESTART_GRACE_S = 10.0  # nodes register again within a heartbeat or two of a registry restart
_UNKNOWN_CAPACITY = NodeCapacity(total_kv_blocks=0, max_num_seqs=0, max_num_batched_tokens=0, block_size=0)
_UNKNOWN_LOAD = NodeLoad(free_kv_blocks=0, num_running=0, num_waiting=0, num_queued_prefill_tokens=0)


@dataclass(frozen=True)
class NodeView:
    """Routing's view of one node. Capacity numbers of 0 mean unknown (a static node not yet polled)."""

    address: str
    role: Role
    node_id: str
    layout_hash: str = ""
    capacity: NodeCapacity = _UNKNOWN_CAPACITY
    load: NodeLoad = _UNKNOWN_LOAD
    draining: bool = False
    prefix_aware: bool = False  # its KV events reach the index, hashed with our block size and seed
    registered: bool = False  # described by the registry (else a static address)
    healthy: bool = True
    updated_at: float = 0.0  # registered: unix time of its record's last write (its last heartbeat)
    kv_backend: str = ""  # registered: its KV transfer backend ("" for a static node: not known)
    pod_uid: str = ""  # registered on Kubernetes: the pod that runs it


class NodeDirectory:
    def __init__(self, static_prefill: Sequence[str] = (), static_decode: Sequence[str] = (),
                 registry_url: str | None = None, block_size: int = 16, hash_seed: str = "tandem",
                 poll_s: float = 0.5, health_interval_s: float = 1.0, health_timeout_s: float = 1.0,
                 security: ChannelSecurity = PLAINTEXT) -> None:
        both = set(static_prefill) & set(static_decode)
        if both:
            raise ValueError(f"{sorted(both)} listed as both prefill and decode nodes")
        self.index = PrefixIndex()
        self.block_size = block_size
        self.fingerprint = hash_fingerprint(hash_seed)
        self.poll_s = poll_s
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self._static: dict[str, NodeView] = {
            address: NodeView(address, role, node_id=address, healthy=False)
            for role, addresses in ((Role.PREFILL, static_prefill), (Role.DECODE, static_decode))
            for address in addresses}
        self._registered: dict[str, NodeView] = {}  # by node id
        self._incarnations: dict[str, int] = {}
        self._kv_seq: dict[str, int | None] = {}  # last delta applied per node; None: unknown since a reload
        self._kv_lock = asyncio.Lock()
        self._warned: set[str] = set()
        self._clients: dict[str, NodeClient] = {}
        self.security = security  # TLS to the nodes (--node-tls-*)
        self.dead = DeadNodes()
        self.liveness = Liveness(polled=self._static)
        self._redis = (aioredis.Redis.from_url(registry_url, decode_responses=True, socket_timeout=5.0,
                                               socket_connect_timeout=2.0) if registry_url else None)
        self._stream_id = "0-0"
        self._registry_run_id: str | None = None  # the Redis server's; another one is a restarted registry
        self._registry_restarted_at = -REGISTRY_RESTART_GRACE_S
        self._start: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False  # the loops check it too: redis-py can swallow a cancellation in a blocking read

    # ---- what routing reads ----
    def nodes(self, role: Role) -> list[NodeView]:
        """The nodes of a role that may take new requests, by address."""
        self._start_soon()
        registered = {n.address: n for n in self._registered.values() if n.role is role}
        static = [n for a, n in self._static.items() if n.role is role and a not in registered]
        healthy = [n for n in static if n.healthy]
        candidates = [*registered.values(), *(healthy if healthy or registered else static)]
        return sorted((n for n in candidates if not n.draining and not self.dead.is_down(n.address)),
                      key=lambda n: n.address)

    def mark_down(self, node: NodeView) -> None:
        """A call just found `node` unreachable (or the proxy gave up on it): routing leaves it out for a back-off
        (proxy.routing.dead_nodes), and the other attempts in flight there are abandoned."""
        already = self.dead.is_down(node.address)  # other requests in flight found it too
        back_off = self.dead.mark_down(node.address)
        if not already:
            logger.warning("%s node %s (%s) is unreachable: out of routing for %.1f s", node.role.value,
                           node.node_id, node.address, back_off)
        self.liveness.lose(node.address, "unreachable")

    def mark_alive(self, node: NodeView) -> None:
        """A call to `node` succeeded."""
        self.dead.mark_alive(node.address)
        self.liveness.check_passed(node.address)

    def is_down(self, node: NodeView) -> bool:
        """Whether `node` is out of routing for a back-off (a call found it unreachable, or the proxy gave up on it)."""
        return self.dead.is_down(node.address)

    def all_nodes(self) -> list[NodeView]:
        """Every node known, healthy or not, draining or not."""
        self._start_soon()
        registered = {n.address: n for n in self._registered.values()}
        return sorted([*registered.values(), *(n for a, n in self._static.items() if a not in registered)],
                      key=lambda n: n.address)

    async def registry_problem(self, timeout_s: float = 2.0) -> str | None:
        """None when the registry answers a PING (or there is none: static nodes only), else why not."""
        if self._redis is None:
            return None
        try:
            await asyncio.wait_for(self._redis.ping(), timeout_s)
        except (RedisError, OSError, TimeoutError) as e:
            return f"the registry does not answer: {type(e).__name__}"
        return None

    def client(self, node: NodeView) -> NodeClient:
        client = self._clients.get(node.address)
        if client is None:
            kind = PrefillClient if node.role is Role.PREFILL else DecodeClient
            client = kind(node.address, self.security)
            self._clients[node.address] = client
        return client

    def prefill_client(self, node: NodeView) -> PrefillClient:
        client = self.client(node)
        assert isinstance(client, PrefillClient), f"{node.address} is not a prefill node"
        return client

    def decode_client(self, node: NodeView) -> DecodeClient:
        client = self.client(node)
        assert isinstance(client, DecodeClient), f"{node.address} is not a decode node"
        return client

    # ---- lifecycle ----
    async def start(self) -> None:
        """Loads the table once and starts the watchers. Idempotent; call it in the loop that will route."""
        if self._start is None:
            self._start = asyncio.create_task(self._start_once())
        await asyncio.shield(self._start)

    def _start_soon(self) -> None:
        """Starts watching on first use from inside an event loop, so that a caller who never awaited start()
        (a health check polled before any request) still sees the table fill."""
        if self._start is None:
            with contextlib.suppress(RuntimeError):  # no running loop: start() will do it
                self._start = asyncio.get_running_loop().create_task(self._start_once())

    async def _start_once(self) -> None:
        if self._redis is not None:
            try:
                self._stream_id = await self._stream_tail()  # before the sets are loaded: see the module doc
                await self.refresh_registry()
            except (RedisError, OSError) as e:
                logger.warning("registry unreachable at start, retrying in the background: %r", e)
            self._tasks += [asyncio.create_task(self._registry_loop(), name="registry-poll"),
                            asyncio.create_task(self._kv_events_loop(), name="registry-kv-events")]
        if self._static:
            await self.poll_static()
        if self._static or self._redis is not None:
            self._tasks.append(asyncio.create_task(self._health_loop(), name="health-checks"))

    async def close(self) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
        if self._redis is not None:
            await self._redis.aclose()  # also ends a blocking read at once
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=3.0)
        for client in self._clients.values():
            await client.close()

    # ---- the registry ----
    async def _registry_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.poll_s)
            try:
                await self.refresh_registry()
            except (RedisError, OSError) as e:
                # keep the last table: its nodes may well be alive, and a dead one fails over on use
                self._warn_once("registry-poll", f"registry unreachable, routing with the last table: {e!r}")
            else:
                self._warned.discard("registry-poll")

    async def refresh_registry(self) -> None:
        """One scan of the registered nodes: who joined, who left, their current load."""
        assert self._redis is not None, "no registry configured"
        run_id = str((await self._redis.info("server")).get("run_id", ""))
        if self._registry_run_id is not None and run_id != self._registry_run_id:
            logger.warning("the registry restarted: keeping its last %d nodes for %.0f s while they register again",
                           len(self._registered), REGISTRY_RESTART_GRACE_S)
            self._registry_restarted_at = time.monotonic()
        self._registry_run_id = run_id
        keep_missing = time.monotonic() - self._registry_restarted_at < REGISTRY_RESTART_GRACE_S
        keys = [key async for key in self._redis.scan_iter(match=NODE_KEY_PATTERN, count=1000)]
        values = await self._redis.mget(keys) if keys else []
        records: dict[str, NodeRecord] = {}
        for key, value in zip(keys, values, strict=True):
            if value is None:
                continue  # expired between the scan and the read
            try:
                record = NodeRecord.from_json(value)
            except ValueError as e:
                self._warn_once(key, f"ignoring registry key {key}: {e}")
                continue
            records[record.node_id] = record
        for node_id in self._registered.keys() - records.keys():
            if keep_missing:
                continue
            logger.info("node %s left the registry", node_id)
            del self._registered[node_id]
            self._incarnations.pop(node_id, None)
            self._kv_seq.pop(node_id, None)
            self.index.drop_node(node_id)
        joined = []
        for node_id, record in records.items():
            self._registered[node_id] = self._state_of(record)
            if self._incarnations.get(node_id) != record.incarnation:
                self._incarnations[node_id] = record.incarnation
                self.dead.mark_alive(record.address)  # a (re)started node: not the process that failed
                joined.append(node_id)
                logger.info("node %s (%s at %s, incarnation %d%s) joined from the registry", node_id,
                            record.role.value, record.address, record.incarnation,
                            f", pod {record.pod_uid}" if record.pod_uid else "")
        if joined:
            await self._rewind_if_stream_reset()
            layouts_loaded: set[str] = set()  # a layout's store set once, however many of its nodes joined
            for node_id in joined:
                layout_hash = self._registered[node_id].layout_hash
                await self._reload_kv(node_id, with_store=layout_hash not in layouts_loaded)
                layouts_loaded.add(layout_hash)

    def _state_of(self, record: NodeRecord) -> NodeView:
        prefix_aware = (record.capacity.block_size == self.block_size
                        and record.hash_fingerprint == self.fingerprint)
        if not prefix_aware:
            self._warn_once(f"hashing:{record.node_id}",
                            f"node {record.node_id} hashes prefixes with block size {record.capacity.block_size} "
                            f"and another seed or size than this proxy (--block-size {self.block_size}, "
                            f"--hash-seed): routing it by load only")
        return NodeView(record.address, record.role, record.node_id, record.layout_hash, record.capacity,
                         record.load, record.draining, prefix_aware, registered=True, updated_at=record.updated_at,
                        kv_backend=record.kv_backend, pod_uid=record.pod_uid)

    # ---- KV events ----
    async def _stream_tail(self) -> str:
        assert self._redis is not None
        last = await self._redis.xrevrange(KV_EVENTS_STREAM, count=1)
        return str(last[0][0]) if last else "0-0"

    async def _rewind_if_stream_reset(self) -> None:
        """Redis restarted empty (stream ids start over): read the new stream from its beginning."""
        tail = await self._stream_tail()
        if _stream_id_key(tail) < _stream_id_key(self._stream_id):
            logger.warning("the KV event stream restarted; reading it from the beginning")
            self._stream_id = "0-0"

    async def _kv_events_loop(self) -> None:
        assert self._redis is not None
        while not self._closing:
            try:
                # decode_responses=True: [[stream, [(entry id, {field: value})]]]
                response: Any = await self._redis.xread({KV_EVENTS_STREAM: self._stream_id}, count=1000,
                                                        block=1000)
            except (RedisError, OSError) as e:
                if self._closing:
                    return
                self._warn_once("kv-events", f"cannot read KV events: {e!r}")
                await asyncio.sleep(self.poll_s)
                continue
            self._warned.discard("kv-events")
            for _stream, entries in response or ():
                for entry_id, fields in entries:
                    self._stream_id = entry_id
                    try:
                        delta = KVDelta.from_fields(fields)
                        await self._apply(delta, entry_id)
                    except ValueError as e:
                        self._warn_once(f"entry:{entry_id}", f"ignoring KV event {entry_id}: {e}")

    async def _apply(self, delta: KVDelta, entry_id: str = "0-0") -> None:
        """Applies one node's delta; `entry_id` (its stream id) dates a store delta's puts."""
        state = self._registered.get(delta.node_id)
        if state is None or not state.prefix_aware:
            return  # not seen in the registry yet: its whole set is loaded when it is
        expected = self._kv_seq.get(delta.node_id)
        if delta.seq == 0 or (expected is not None and delta.seq != expected + 1):
            await self._reload_kv(delta.node_id)  # the sets reflect this entry already
            self._kv_seq[delta.node_id] = delta.seq
            return
        stored, removed = _from_hex(delta.stored), _from_hex(delta.removed)
        async with self._kv_lock:
            if delta.tier is Tier.STORE:
                put_at = _stream_id_key(entry_id)[0] / 1000  # Redis's clock when the node published the puts
                self.index.add_store_blocks(state.layout_hash, ((h, put_at) for h in stored))
            else:
                self.index.store(delta.node_id, stored, delta.tier)
                self.index.remove(delta.node_id, removed, delta.tier)
            self._kv_seq[delta.node_id] = delta.seq

    async def _reload_kv(self, node_id: str, with_store: bool = True) -> None:
        """Loads a node's sets, and (`with_store`) the store set of its layout."""
        assert self._redis is not None
        async with self._kv_lock:
            state = self._registered.get(node_id)
            if state is None or not state.prefix_aware:
                return
            async with self._redis.pipeline(transaction=True) as pipe:  # one snapshot of every set
                for tier in NODE_TIERS:
                    pipe.smembers(kv_set_key(node_id, tier))
                if with_store:  # expired entries included: the index drops them
                    pipe.zrange(store_set_key(state.layout_hash), 0, -1, withscores=True)
                replies: list[Any] = await pipe.execute()
            if node_id not in self._registered:  # it may have left while we waited
                return
            for tier, members in zip(NODE_TIERS, replies, strict=False):
                self.index.replace(node_id, _from_hex(members), tier)
            if with_store:
                puts = replies[len(NODE_TIERS)]
                self.index.add_store_blocks(state.layout_hash, zip(_from_hex(h for h, _ in puts),
                                                                   (float(t) for _, t in puts), strict=True))
            self._kv_seq[node_id] = None

    # ---- health checks ----
    async def _health_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.health_interval_s)
            await self.check_health()

    async def check_health(self) -> None:
        """One round of checks: every static node, and every other node with attempts in flight."""
        in_flight = [a for a in self.liveness.to_check() if a in self._clients]
        await asyncio.gather(self.poll_static(), *(self._check_in_flight(a) for a in in_flight))

    async def poll_static(self) -> None:
        await asyncio.gather(*(self._poll_static_node(node) for node in list(self._static.values())))

    async def _poll_static_node(self, node: NodeView) -> None:
        client = self.client(node)
        health, stats = await asyncio.gather(client.health(self.health_timeout_s),
                                             client.stats(self.health_timeout_s), return_exceptions=True)
        failure = check_failure(health)
        if failure is not None:
            lost = self.liveness.check_failed(node.address, failure)
            if node.healthy and lost:
                logger.warning("%s node %s is unhealthy: %s", node.role.value, node.address, failure)
                self._static[node.address] = dataclasses.replace(node, healthy=False)
            return
        assert isinstance(health, NodeHealth), "a passed check has an answer"
        self.liveness.check_passed(node.address)
        self.dead.mark_alive(node.address)
        if not node.healthy:
            logger.info("%s node %s (%s) is healthy", node.role.value, node.address, health.node_id)
        # a busy node's Stats may come late (it waits for the engine's step): keep the last load then
        if isinstance(stats, BaseException) and not isinstance(stats, grpc.aio.AioRpcError):
            raise stats
        capacity, load = (stats.capacity, stats.load) if isinstance(stats, NodeStats) else (node.capacity, node.load)
        self._static[node.address] = NodeView(node.address, node.role, health.node_id, health.layout_hash,
                                               capacity, load)

    async def _check_in_flight(self, address: str) -> None:
        """Health of a registered node that requests are waiting on (its heartbeats say less: the registry entry
        of a frozen node lives on for the TTL, and an entry gone is no proof the node is)."""
        try:
            health: NodeHealth | grpc.aio.AioRpcError = await self._clients[address].health(self.health_timeout_s)
        except grpc.aio.AioRpcError as e:
            health = e
        failure = check_failure(health)
        if failure is None:
            self.liveness.check_passed(address)
        elif self.liveness.check_failed(address, failure):
            logger.warning("node %s fails its health checks (%s): abandoning the requests in flight there", address,
                           failure)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("%s", message)


def _from_hex(hashes: Iterable[str]) -> list[bytes]:
    """Raises ValueError on a malformed hash."""
    return [bytes.fromhex(h) for h in hashes]


def _stream_id_key(stream_id: str) -> tuple[int, int]:
    millis, _, seq = stream_id.partition("-")
    with contextlib.suppress(ValueError):
        return int(millis), int(seq or 0)
    return 0, 0
