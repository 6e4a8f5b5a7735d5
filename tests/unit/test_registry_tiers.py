"""KV events per tier through a real redis-server: a node's registrar publishes its pool's (device), its host
tier's (host) and its store puts (store), and the proxy's directory indexes each in its tier, from the stream and
from the snapshots a late reader loads."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import pytest
import redis

from engine.cache.block_pool import BlockPool
from engine.cache.host_tier import HostTier
from engine.hashing import BlockHash
from node_common.registrar import NodeRegistrar
from proxy.routing.directory import NodeDirectory
from proxy.routing.prefix_index import PrefixMatch
from tests.integration.processes import RedisServer
from wire import NodeIdentity, Role
from wire.registry import STORE_HINT_TTL_S, Tier, kv_set_key, store_set_key

T = TypeVar("T")
H = [bytes([i]) * 16 for i in range(8)]  # stand-ins for a prompt's chained hashes
NODE, LAYOUT, SEED, BLOCK = "p-1", "layout-a", "s", 4


class Engine:
    """The LLMEngine calls a registrar makes, over a real block pool and host tier."""

    def __init__(self) -> None:
        self.pool = BlockPool(8)
        self.tiers = SimpleNamespace(host=HostTier(4))

    def enable_kv_events(self) -> None:
        if self.pool.events is None:
            self.pool.events = []

    def drain_kv_events(self) -> list[Any]:
        events = self.pool.events
        if not events:
            return []
        self.pool.events = []
        return events

    def cached_block_hashes(self) -> list[BlockHash]:
        return self.pool.cached_hashes()

    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(total_kv_blocks=8, max_num_seqs=4, max_num_batched_tokens=64, block_size=BLOCK,
                               free_kv_blocks=8, num_running=0, num_waiting=0, num_queued_prefill_tokens=0)

    def cache(self, block_hash: BlockHash) -> None:
        """A computed block, freed: findable until the pool needs it."""
        block_id = self.pool.allocate(1)[0]
        self.pool.cache(block_id, block_hash, [block_hash[0]])
        self.pool.free([block_id])


class AsyncEngine:
    """AsyncEngine.call without a thread: the test's mutations and the registrar's calls take turns on the loop."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.healthy = True
        self.error = None

    async def call(self, fn: Callable[[Any], T]) -> T:
        return fn(self.engine)


class Store:
    """StoreTier.drain_stored."""

    def __init__(self) -> None:
        self.stored: list[BlockHash] = []

    def drain_stored(self) -> list[BlockHash]:
        stored, self.stored = self.stored, []
        return stored


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    try:
        yield server
    finally:
        server.stop()


async def eventually(condition: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def directory(server: RedisServer) -> NodeDirectory:
    return NodeDirectory(registry_url=server.url, block_size=BLOCK, hash_seed=SEED, poll_s=0.05)


def match(d: NodeDirectory) -> PrefixMatch | None:
    return d.index.match(H[:6], {NODE: LAYOUT}).get(NODE)


def test_host_and_store_events_reach_the_proxys_index_in_their_tiers(redis_server: RedisServer) -> None:
    engine, store = Engine(), Store()
    engine.cache(H[0])
    engine.cache(H[1])
    engine.tiers.host.reserve(H[2], [2])  # before registration: in the snapshot
    store.stored = [H[3]]  # put before registration: published with it

    async def main() -> None:
        serving = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = serving.sockets[0].getsockname()[1]
        identity = NodeIdentity(NODE, Role.PREFILL, f"127.0.0.1:{port}", "m", LAYOUT, "nixl", SEED)
        registrar = NodeRegistrar(redis_server.url, AsyncEngine(engine), identity,  # type: ignore[arg-type]
                                  ("127.0.0.1", port), heartbeat_s=0.2, ttl_s=2.0, events_interval_s=0.02,
                                  store=store)
        early = directory(redis_server)
        await early.start()
        await registrar.start()
        try:
            await eventually(lambda: match(early) == PrefixMatch(2, 1, 1), "the snapshot's tiers")
            engine.tiers.host.reserve(H[4], [4])
            await eventually(lambda: match(early) == PrefixMatch(2, 2, 1), "a host STORED event")
            engine.tiers.host.discard(H[2])
            await eventually(lambda: match(early) == PrefixMatch(2), "a host REMOVED event")
            store.stored = [H[2]]
            await eventually(lambda: match(early) == PrefixMatch(2, 1, 2), "a store put")
            engine.pool.reset_prefix_cache()  # the pool's events still come as device ones
            await eventually(lambda: match(early) is None, "the pool's REMOVED events")
            assert early.index.match(H[2:5], {NODE: LAYOUT})[NODE] == PrefixMatch(0, 1, 2)

            late = directory(redis_server)  # loads the sets and the store's zset
            await late.start()
            try:
                await eventually(lambda: NODE in late.index.node_ids, "the late reader's snapshot")
                assert late.index.match(H[2:5], {NODE: LAYOUT})[NODE] == PrefixMatch(0, 1, 2)
                assert late.index.num_blocks(NODE, Tier.HOST) == 1 and late.index.num_blocks(NODE) == 0
            finally:
                await late.close()

            sync = redis.Redis.from_url(redis_server.url, decode_responses=True)
            assert sync.smembers(kv_set_key(NODE, Tier.HOST)) == {H[4].hex()}
            puts = dict(sync.zrange(store_set_key(LAYOUT), 0, -1, withscores=True))
            assert puts.keys() == {H[2].hex(), H[3].hex()} and all(abs(t - time.time()) < 10 for t in puts.values())
            assert 0 < sync.pttl(store_set_key(LAYOUT)) <= STORE_HINT_TTL_S * 1000
            await registrar.stop()
            # the node's own sets leave with it; its store puts stay for the other nodes of its layout
            assert not sync.exists(kv_set_key(NODE), kv_set_key(NODE, Tier.HOST))
            assert sync.zcard(store_set_key(LAYOUT)) == 2
            sync.close()
        finally:
            await registrar.stop()
            await early.close()
            serving.close()

    asyncio.run(main())


def test_a_store_put_is_trimmed_once_older_than_the_hint_ttl(redis_server: RedisServer) -> None:
    sync = redis.Redis.from_url(redis_server.url, decode_responses=True)
    key = store_set_key(LAYOUT)
    sync.zadd(key, {H[6].hex(): time.time() - STORE_HINT_TTL_S - 1, H[7].hex(): time.time() - 1})
    engine, store = Engine(), Store()
    store.stored = [H[0]]

    async def main() -> None:
        serving = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = serving.sockets[0].getsockname()[1]
        identity = NodeIdentity(NODE, Role.PREFILL, f"127.0.0.1:{port}", "m", LAYOUT, "nixl", SEED)
        registrar = NodeRegistrar(redis_server.url, AsyncEngine(engine), identity,  # type: ignore[arg-type]
                                  ("127.0.0.1", port), heartbeat_s=0.2, ttl_s=2.0, events_interval_s=0.02,
                                  store=store)
        await registrar.start()
        try:
            await eventually(lambda: sync.zscore(key, H[0].hex()) is not None, "the put")
            assert set(sync.zrange(key, 0, -1)) == {H[0].hex(), H[7].hex()}
        finally:
            await registrar.stop()
            serving.close()

    asyncio.run(main())
    sync.close()
