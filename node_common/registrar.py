"""A node's registrar: keeps its entry in the cluster registry (Redis) while it serves: who it is, how loaded it
is, which prefixes it holds. The keys and records are wire.registry's; the proxy reads them
(proxy/routing/directory.py).

- Heartbeats rewrite the node's record with a TTL. They write with `SET ... XX`: a refused write tells a node
  that came back that it had expired, and it registers again from scratch.
- KV events, per tier (wire.registry `Tier`): the engine's block pool events (device) and host tier events (host)
  are drained, each tier's coalesced into a `KVDelta`, and published as the update of the node's set of that tier
  plus one stream entry; the hashes the node put in the cluster store (its `StoreTier`, if any) since the last
  tick are published as a store delta, added to the store set of the node's KV layout (a ZSET of put times,
  trimmed to wire.registry's STORE_HINT_TTL_S and STORE_HINT_MAX_BLOCKS: the store evicts without telling).
  One tick's entries are one MULTI, with consecutive seqs.

Why a stream plus a set rather than pub/sub: pub/sub drops whatever a reader misses (a proxy that starts
late or reconnects, a slow one) and has no position to resume from. A stream is read from a position by
any number of proxies, each at its own pace, and is trimmed to a bounded length; the set makes any loss
(trimmed history, a late reader) recoverable without replaying history. A delta's set update and its
stream entry are one MULTI, and an entry only sets hashes present or absent, so a reader's snapshot plus
every entry after some point before it gives the node's exact state (replaying entries the snapshot
already reflects changes nothing). The store set is no node's state but a hint every put adds to: its entries
only get added or refreshed (and expire), so the same holds for it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import secrets
import socket
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError
from redis.typing import EncodableT, FieldT

from engine.cache.block_pool import KVEvent, KVEventKind
from engine.hashing import BlockHash
from node_common.load import engine_capacity, engine_load
from wire import (
    KV_EVENTS_STREAM,
    STREAM_MAX_LEN,
    KVDelta,
    NodeCapacity,
    NodeIdentity,
    NodeLoad,
    NodeRecord,
    hash_fingerprint,
    kv_set_key,
    node_key,
)
from wire.registry import STORE_HINT_MAX_BLOCKS, STORE_HINT_TTL_S, Tier, store_set_key

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class StorePuts(Protocol):
    """What the registrar needs of a node's store tier (node_common/store_tier.py StoreTier)."""

    def drain_stored(self) -> list[BlockHash]:
        """The hashes of the blocks put in the store since the last call (thread-safe)."""
        ...


@dataclass(frozen=True)
class TierEvents:
    """The KV events of a node's own tiers, drained in one engine-thread call."""

    device: list[KVEvent]
    host: list[KVEvent]


def enable_tier_events(engine: LLMEngine) -> None:
    """Starts recording the pool's and the host tier's changes (on the engine thread)."""
    engine.enable_kv_events()
    if engine.tiers is not None and engine.tiers.host.events is None:
        engine.tiers.host.events = []


def drain_tier_events(engine: LLMEngine) -> TierEvents:
    """The changes of the pool and the host tier since the last drain, oldest first (on the engine thread)."""
    host: list[KVEvent] = []
    if engine.tiers is not None and engine.tiers.host.events:
        host, engine.tiers.host.events = engine.tiers.host.events, []
    return TierEvents(engine.drain_kv_events(), host)


def cached_tier_hashes(engine: LLMEngine) -> dict[Tier, list[BlockHash]]:
    """Every block the pool and the host tier can find now (on the engine thread)."""
    host = engine.tiers.host.cached_hashes() if engine.tiers is not None else []
    return {Tier.DEVICE: engine.cached_block_hashes(), Tier.HOST: host}


def coalesce(events: Iterable[KVEvent]) -> tuple[list[str], list[str]]:
    """The engine's block pool events as a KVDelta's (stored, removed) hex hashes: their net effect in order,
    each hash ending as its last event says."""
    last: dict[bytes, bool] = {}
    for event in events:
        last[event.block_hash] = event.kind is KVEventKind.STORED
    return [h.hex() for h, stored in last.items() if stored], [h.hex() for h, stored in last.items() if not stored]


# ---- the node side ----
def add_registry_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--registry", default=None, metavar="redis://HOST:PORT",
                        help="register in this Redis, with heartbeats and KV events (default: no registry)")
    parser.add_argument("--advertise-address", default=None, metavar="HOST:PORT",
                        help="the gRPC address others reach this node at (default: --host:--port)")
    parser.add_argument("--heartbeat-seconds", type=float, default=1.0)
    parser.add_argument("--registry-ttl-seconds", type=float, default=3.0,
                        help="a node whose heartbeats stop leaves the registry after this long")


class NodeRegistrar:
    """Keeps a node's record, KV set and KV events in Redis while the node serves.

    Two tasks: heartbeats (the record with fresh load, every `heartbeat_s`) and KV events (drained from the
    engine, and from `store` when the node has a cluster store, every `events_interval_s`). They are separate so
    that a long engine step delays the KV events but never the heartbeat: a busy node must not look dead.
    """

    def __init__(self, url: str, engine: AsyncEngine, identity: NodeIdentity, serving_address: tuple[str, int],
                 heartbeat_s: float = 1.0, ttl_s: float = 3.0, events_interval_s: float = 0.1,
                 store: StorePuts | None = None) -> None:
        if ttl_s <= heartbeat_s:
            raise ValueError(f"the registry TTL ({ttl_s} s) must exceed the heartbeat interval ({heartbeat_s} s)")
        self.redis = aioredis.Redis.from_url(url, decode_responses=True, socket_timeout=max(1.0, heartbeat_s),
                                             socket_connect_timeout=max(1.0, heartbeat_s))
        self.engine = engine
        self.store = store
        self.identity = replace(identity, incarnation=identity.incarnation or secrets.randbits(62))
        self.serving_address = serving_address
        self.heartbeat_s = heartbeat_s
        self.ttl_ms = int(ttl_s * 1000)
        self.events_interval_s = events_interval_s
        self.draining = False
        self._node_key = node_key(identity.node_id)
        self._set_keys = {tier: kv_set_key(identity.node_id, tier) for tier in (Tier.DEVICE, Tier.HOST)}
        self._store_key = store_set_key(identity.layout_hash)
        self._store_pending: list[str] = []  # hex hashes put in the store, not yet in Redis (kept over a failure)
        self._registered = asyncio.Event()  # the record is in Redis (a node's readiness needs it)
        self._seq = 0
        self._capacity: NodeCapacity | None = None
        self._load: NodeLoad | None = None
        self._load_call: asyncio.Future[NodeLoad] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False  # the loops check it too: redis-py can swallow a cancellation
        self._last_error_log = 0.0

    @property
    def registered(self) -> bool:
        """Whether the node's record is in the registry as far as this process knows (a failed write or a
        refused heartbeat clears it until the node has registered again)."""
        return self._registered.is_set()

    # ---- lifecycle ----
    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._kv_events_loop(), name="registry-kv-events"),
                       asyncio.create_task(self._heartbeat_loop(), name="registry-heartbeat")]

    async def stop(self) -> None:
        """Stops both tasks and deregisters (best effort: the TTL removes the record anyway)."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=3.0)
        with contextlib.suppress(RedisError, OSError):
            await self.redis.delete(self._node_key, *self._set_keys.values())
            logger.info("deregistered %s", self.identity.node_id)
        await self.redis.aclose()

    async def set_draining(self, draining: bool = True) -> None:
        """Announces at once that the node takes no new requests (or takes them again)."""
        self.draining = draining
        if self._registered.is_set():
            await self._heartbeat()

    # ---- the two loops ----
    async def _kv_events_loop(self) -> None:
        await self._wait_until_serving()
        while not self._stopping:
            try:
                if not self._registered.is_set():
                    await self._register()
                else:
                    await self._publish_kv_events()
            except (RedisError, OSError) as e:
                # what reached Redis is unknown: rewrite the whole set once it answers again
                self._registered.clear()
                self._log_error("registry unreachable", e)
            except RuntimeError as e:  # the engine thread stopped: stop advertising this node
                if self.engine.error is not None:
                    logger.error("the engine died, leaving the registry: %s", e)
                with contextlib.suppress(RedisError, OSError):
                    await self.redis.delete(self._node_key, *self._set_keys.values())
                return
            await asyncio.sleep(self.events_interval_s)

    async def _heartbeat_loop(self) -> None:
        while not self._stopping:
            await self._registered.wait()
            try:
                await self._heartbeat()
            except (RedisError, OSError) as e:
                self._log_error("heartbeat failed", e)
            except RuntimeError:  # the engine thread died: let the record expire (the other loop removes it)
                return
            await asyncio.sleep(self.heartbeat_s)

    # ---- steps ----
    async def _wait_until_serving(self) -> None:
        """Registers only once the engine runs and the gRPC port accepts connections."""
        host, port = self.serving_address
        host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        while True:
            if self.engine.healthy:
                try:
                    _, writer = await asyncio.open_connection(host, port)
                except OSError:
                    pass
                else:
                    writer.close()
                    return
            await asyncio.sleep(0.05)

    async def _register(self) -> None:
        """Writes the record and the node's whole KV sets, and tells readers (seq 0) to reload them."""
        def snapshot(engine: LLMEngine) -> tuple[dict[Tier, list[BlockHash]], NodeCapacity, NodeLoad]:
            enable_tier_events(engine)
            drain_tier_events(engine)  # superseded by the snapshot taken in the same engine-thread call
            return cached_tier_hashes(engine), engine_capacity(engine), engine_load(engine)

        hashes, self._capacity, self._load = await self.engine.call(snapshot)
        self._drain_store_puts()
        self._seq = 0
        async with self.redis.pipeline(transaction=True) as pipe:
            for tier, key in self._set_keys.items():
                pipe.delete(key)
                for chunk in _chunks([h.hex() for h in hashes[tier]], 10_000):
                    pipe.sadd(key, *chunk)
                pipe.pexpire(key, self.ttl_ms)
            self._add_store_puts(pipe)
            pipe.xadd(KV_EVENTS_STREAM, _stream_entry(KVDelta(self.identity.node_id, 0)),
                      maxlen=STREAM_MAX_LEN, approximate=True)
            pipe.set(self._node_key, self._record().to_json(), px=self.ttl_ms)
            await pipe.execute()
        self._store_pending = []
        self._registered.set()
        logger.info("registered %s (%s at %s, incarnation %d%s) with %d cached blocks (%d in host memory)",
                    self.identity.node_id, self.identity.role.value, self.identity.address, self.identity.incarnation,
                    f", pod {self.identity.pod_uid}" if self.identity.pod_uid else "", len(hashes[Tier.DEVICE]),
                    len(hashes[Tier.HOST]))

    async def _publish_kv_events(self) -> None:
        events = await self.engine.call(drain_tier_events)
        self._drain_store_puts()
        deltas: list[KVDelta] = []
        for tier, tier_events in ((Tier.DEVICE, events.device), (Tier.HOST, events.host)):
            if tier_events:
                stored, removed = coalesce(tier_events)
                deltas.append(KVDelta(self.identity.node_id, self._seq + len(deltas) + 1, tuple(stored),
                                      tuple(removed), tier))
        if self._store_pending:
            deltas.append(KVDelta(self.identity.node_id, self._seq + len(deltas) + 1, tuple(self._store_pending),
                                  tier=Tier.STORE))
        if not deltas:
            return
        async with self.redis.pipeline(transaction=True) as pipe:
            for delta in deltas:
                if delta.tier is Tier.STORE:
                    self._add_store_puts(pipe)
                else:
                    key = self._set_keys[delta.tier]
                    for chunk in _chunks(delta.stored, 10_000):
                        pipe.sadd(key, *chunk)
                    for chunk in _chunks(delta.removed, 10_000):
                        pipe.srem(key, *chunk)
                    pipe.pexpire(key, self.ttl_ms)
                pipe.xadd(KV_EVENTS_STREAM, _stream_entry(delta), maxlen=STREAM_MAX_LEN, approximate=True)
            await pipe.execute()
        self._seq += len(deltas)
        self._store_pending = []

    def _drain_store_puts(self) -> None:
        """Moves the store's new puts to the pending list (the newest STORE_HINT_MAX_BLOCKS of them: older ones
        would be trimmed anyway)."""
        if self.store is None:
            return
        self._store_pending += [h.hex() for h in self.store.drain_stored()]
        del self._store_pending[:-STORE_HINT_MAX_BLOCKS]

    def _add_store_puts(self, pipe: Pipeline) -> None:
        """Queues the pending puts into the layout's store set, stamped now, and its trimming (see wire.registry:
        a hint that expires, since the store evicts without telling)."""
        if not self._store_pending:
            return
        now = time.time()
        for chunk in _chunks(self._store_pending, 10_000):
            pipe.zadd(self._store_key, dict.fromkeys(chunk, now))
        pipe.zremrangebyscore(self._store_key, "-inf", now - STORE_HINT_TTL_S)
        pipe.zremrangebyrank(self._store_key, 0, -STORE_HINT_MAX_BLOCKS - 1)  # the newest puts stay
        pipe.pexpire(self._store_key, int(STORE_HINT_TTL_S * 1000))

    async def _heartbeat(self) -> None:
        await self._sample_load()
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self._node_key, self._record().to_json(), px=self.ttl_ms, xx=True)
            for key in self._set_keys.values():
                pipe.pexpire(key, self.ttl_ms)
            written, *_ = await pipe.execute()
        if not written:
            logger.warning("the registry had dropped %s (heartbeats stopped for longer than the TTL): "
                           "registering again", self.identity.node_id)
            self._registered.clear()

    async def _sample_load(self) -> None:
        """Fresh load when the engine answers within half a heartbeat, else the last one."""
        if self._load_call is None or self._load_call.done():
            self._load_call = asyncio.ensure_future(self.engine.call(engine_load))
        try:
            self._load = await asyncio.wait_for(asyncio.shield(self._load_call), self.heartbeat_s / 2)
        except TimeoutError:
            pass

    def _record(self) -> NodeRecord:
        assert self._capacity is not None and self._load is not None, "the record is written after a snapshot"
        identity = self.identity
        return NodeRecord(node_id=identity.node_id, role=identity.role, address=identity.address,
                          model=identity.model, layout_hash=identity.layout_hash, kv_backend=identity.kv_backend,
                          incarnation=identity.incarnation, hash_fingerprint=hash_fingerprint(identity.hash_seed),
                          capacity=self._capacity, load=self._load, draining=self.draining, updated_at=time.time(),
                          pod_uid=identity.pod_uid)

    def _log_error(self, what: str, error: BaseException) -> None:
        now = time.monotonic()
        if now - self._last_error_log > 10.0:  # one line per outage-ish, not one per tick
            logger.warning("%s: %r", what, error)
            self._last_error_log = now


def _stream_entry(delta: KVDelta) -> dict[FieldT, EncodableT]:
    return {key: value for key, value in delta.to_fields().items()}  # redis-py's field types


def _chunks(items: Sequence[str], size: int) -> Iterable[Sequence[str]]:
    for begin in range(0, len(items), size):
        yield items[begin:begin + size]


def advertised_address(args: argparse.Namespace) -> str:
    if args.advertise_address:
        return str(args.advertise_address)
    host = args.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn()
    return f"{host}:{args.port}"


@contextlib.asynccontextmanager
async def registration(args: argparse.Namespace, engine: AsyncEngine, identity: NodeIdentity,
                       store: StorePuts | None = None) -> AsyncIterator[NodeRegistrar | None]:
    """Registers the node for the duration of the block when `--registry` was given (else does nothing); `store`:
    the node's cluster store tier, whose puts it publishes."""
    if not args.registry:
        yield None
        return
    try:
        registrar = NodeRegistrar(args.registry, engine, identity, (args.host, args.port),
                                  heartbeat_s=args.heartbeat_seconds, ttl_s=args.registry_ttl_seconds, store=store)
    except ValueError as e:  # a malformed URL, a TTL shorter than the heartbeat
        raise SystemExit(f"--registry: {e}") from None
    await registrar.start()
    try:
        yield registrar
    finally:
        await registrar.stop()
