"""A node's door to the cluster KV store (docs/architecture.md#kv-tiers): gets before computing, puts after.

- Before a prompt is added to the engine (`fetch`), its full blocks that neither the pool nor the host tier hold
  are looked up in the store, in order, stopping at the first miss. Each value is checked (its token ids and the
  block's checksum, the one a KV handoff carries: kvtransfer/kv_store.py) and imported into the host tier, where
  the engine's prefix lookup finds it and loads it like any host hit. A missing, corrupt or unreachable block is
  a miss: the engine computes it.
- After computing (`publish`): a prefill node puts the prompt's blocks once its first token is out; a decode
  node puts prompt and answer when the request finishes (push: the node that computed the blocks writes them,
  so the next turn's prefill node, any of them, pulls them without asking the decode node; docs say why).
  The bytes are read from the pool on the engine thread (one hop, in the background: never on a request's
  path), packed and put on a thread of their own; blocks already in the store, or put recently, are skipped.

The store's calls never raise and return within a bound while the store is down (kvtransfer/kv_store.py), and
nothing here waits on a put: with the store gone a node serves as if it had none.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from engine.async_engine import AsyncEngine
from engine.hashing import BlockHash, block_hashes
from engine.kv_tiers import KVTiers
from engine.llm_engine import LLMEngine
from kvtransfer.kv_store import MooncakeKVStore, pack_block, store_key, unpack_block
from settings.cluster import KVTierSettings, store_address
from wire import TierStats

logger = logging.getLogger(__name__)

StoreBlock = tuple[BlockHash, Sequence[int], bytes]  # a block got from the store: hash, token ids, checked bytes

RECENT_PUTS = 1 << 16  # hashes a node remembers having put (skipped without asking the store)
STORE_BUFFER_BYTES = 64 << 20  # the store client's own buffer, which gets and puts pass through (a batch at most)
MAX_PENDING_PUT_BYTES = 256 << 20  # puts waiting for the put thread beyond this are dropped (the store is slow)


@dataclass
class StoreTierStats:
    num_queried_blocks: int = 0  # blocks asked of the store (those the node did not hold)
    num_fetched_blocks: int = 0  # blocks got from the store and imported into the host tier
    num_corrupt_blocks: int = 0  # values that failed their checks (treated as misses)
    num_put_blocks: int = 0
    num_dropped_puts: int = 0  # blocks not put because the put thread was too far behind


class StoreTier:
    def __init__(self, store: MooncakeKVStore, engine: AsyncEngine, namespace: str) -> None:
        """`namespace`: the node's KV layout hash (model, dtypes, block size, hash seed): only nodes whose blocks
        are interchangeable share keys."""
        tiers = engine.engine.tiers
        if tiers is None:
            raise ValueError("a KV store needs a host tier to stage the blocks it gets (--kv-offloading-size)")
        self.store = store
        self.engine = engine
        self.namespace = namespace
        self.block_size = engine.engine.block_size
        self.hash_seed = engine.engine.config.hash_seed
        self.block_bytes = tiers.block_bytes
        self.stats = StoreTierStats()
        self._recent: OrderedDict[BlockHash, None] = OrderedDict()
        self._recent_lock = threading.Lock()  # publish on the event loop, stage on the engine thread
        self._pending_put_bytes = 0
        self._errors_seen = 0
        # put since the last drain_stored (the registrar's KV events); None until something drains them
        self._stored: list[BlockHash] | None = None
        self._gets = ThreadPoolExecutor(1, thread_name_prefix="kv-store-get")
        self._puts = ThreadPoolExecutor(1, thread_name_prefix="kv-store-put")
        self._background: set[asyncio.Task[None]] = set()

    def _blocks(self, token_ids: Sequence[int], num_tokens: int) -> list[tuple[BlockHash, Sequence[int]]]:
        hashes = block_hashes(token_ids[:num_tokens], self.block_size, self.hash_seed)
        bs = self.block_size
        return [(h, token_ids[i * bs:(i + 1) * bs]) for i, h in enumerate(hashes)]

    async def fetch(self, token_ids: Sequence[int]) -> list[StoreBlock]:
        """The prompt's leading blocks the store holds and this node does not, checked; `stage` them in the engine
        hop that adds the request. The prompt's last token is always computed (it gives the first logits), so its
        block never is a hit. No engine hop here: which blocks the node holds is read off the engine thread, a
        hint (a block evicted meanwhile is recomputed, one loaded meanwhile is skipped when staged)."""
        blocks = self._blocks(token_ids, len(token_ids) - 1)
        if not blocks:
            return []
        return await asyncio.get_running_loop().run_in_executor(self._gets, self._get, blocks)

    def _get(self, blocks: list[tuple[BlockHash, Sequence[int]]]) -> list[StoreBlock]:
        tiers = _tiers(self.engine.engine)
        wanted = blocks[tiers.num_local_blocks(blocks):]
        if not wanted:
            return []
        self.stats.num_queried_blocks += len(wanted)
        values = self.store.get_prefix([store_key(self.namespace, h) for h, _ in wanted])
        found: list[StoreBlock] = []
        for (block_hash, tokens), value in zip(wanted, values, strict=False):
            data = unpack_block(value, tokens, self.block_bytes)
            if data is None:
                self.stats.num_corrupt_blocks += 1
                logger.warning("KV store block %s failed its checks: recomputed", block_hash.hex())
                break
            found.append((block_hash, tokens, data))
        return found

    def stage(self, engine: LLMEngine, found: list[StoreBlock]) -> int:
        """On the engine thread, before the request is added: writes fetched blocks into the host tier."""
        if not found:
            return 0
        imported = _tiers(engine).import_blocks(found)
        self.stats.num_fetched_blocks += imported
        with self._recent_lock:
            for block_hash, _, _ in found[:imported]:
                self._remember_locked(block_hash)  # in the store already: not worth putting again
        return imported

    def publish(self, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Puts the full blocks of the first `num_computed_tokens` tokens in the store, in the background."""
        if self.store.num_errors != self._errors_seen:  # an outage: a restarted master has lost every block
            self._errors_seen = self.store.num_errors
            with self._recent_lock:
                self._recent.clear()
        with self._recent_lock:  # claimed now, so that a concurrent publish of the same prefix skips them
            blocks = [b for b in self._blocks(token_ids, num_computed_tokens) if b[0] not in self._recent]
            for block_hash, _ in blocks:
                self._remember_locked(block_hash)
        if not blocks:
            return
        task = asyncio.get_running_loop().create_task(self._publish(blocks))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _publish(self, blocks: list[tuple[BlockHash, Sequence[int]]]) -> None:
        try:
            datas = await self.engine.call(lambda e: _tiers(e).export_blocks(blocks))
        except Exception:  # noqa: BLE001 - the engine stopped: nothing to put
            logger.debug("reading KV blocks for the store failed", exc_info=True)
            self._forget(h for h, _ in blocks)
            return
        items: list[tuple[str, bytes]] = []
        for (block_hash, tokens), data in zip(blocks, datas, strict=True):
            if data is None:  # evicted meanwhile: it and the blocks after it (their prefix is incomplete) wait
                self._forget(h for h, _ in blocks[len(items):])
                break
            items.append((store_key(self.namespace, block_hash), pack_block(tokens, data)))
        size = sum(len(v) for _, v in items)
        if not items:
            return
        if self._pending_put_bytes + size > MAX_PENDING_PUT_BYTES:
            self.stats.num_dropped_puts += len(items)
            self._forget(h for h, _ in blocks[:len(items)])
            return
        self._pending_put_bytes += size
        try:
            stored = await asyncio.get_running_loop().run_in_executor(self._puts, self.store.put_many, items)
        finally:
            self._pending_put_bytes -= size
        self.stats.num_put_blocks += stored
        with self._recent_lock:
            if self._stored is not None:  # put_many stores a batch's leading items
                self._stored.extend(h for h, _ in blocks[:stored])
        if stored < len(items):  # the store is down or full: let a later request try these again
            self._forget(h for h, _ in blocks[stored:len(items)])

    def _remember_locked(self, block_hash: BlockHash) -> None:
        self._recent[block_hash] = None
        self._recent.move_to_end(block_hash)
        while len(self._recent) > RECENT_PUTS:
            self._recent.popitem(last=False)

    def _forget(self, hashes: Iterable[BlockHash]) -> None:
        with self._recent_lock:
            for block_hash in hashes:
                self._recent.pop(block_hash, None)

    def drain_stored(self) -> list[BlockHash]:
        """The hashes of the blocks put in the store since the last call (thread-safe)."""
        with self._recent_lock:
            stored, self._stored = self._stored or [], []
        return stored

    def tier_stats(self) -> TierStats:
        s, store = self.stats, self.store
        return TierStats(queries=s.num_queried_blocks * self.block_size, hits=s.num_fetched_blocks * self.block_size,
                         read_bytes=store.bytes_read, write_bytes=store.bytes_written,
                         errors=store.num_errors + s.num_corrupt_blocks)

    def close(self) -> None:
        """At shutdown, after the engine: puts still queued are dropped (the store is a cache)."""
        self._gets.shutdown(wait=False, cancel_futures=True)
        self._puts.shutdown(wait=False, cancel_futures=True)
        self.store.close()


def open_store_tier(settings: KVTierSettings, engine: AsyncEngine, namespace: str, host: str) -> StoreTier | None:
    """The node's store tier when the cluster has a KV store (`--kv-store`), else None."""
    if settings.kv_store is None:
        return None
    if settings.kv_store == "mooncake":
        raise ValueError("--kv-store mooncake starts a store under tandem serve only; give a node the store's "
                         "address: mooncake://HOST:PORT")
    store = MooncakeKVStore(store_address(settings.kv_store), local_hostname=host,
                            segment_bytes=int(settings.kv_store_segment_size * 2**30),
                            buffer_bytes=STORE_BUFFER_BYTES)
    return StoreTier(store, engine, namespace)


def _tiers(engine: LLMEngine) -> KVTiers:
    assert engine.tiers is not None  # StoreTier checks at construction
    return engine.tiers
