"""The engine's side of the KV tiers below its pool: the host tier, and the door the cluster store comes through.

The host tier (engine/cache/host_tier.py for the index, engine/host_kv_pool.py for the bytes) is the engine's own:
the KV manager plans spills and loads, `run_copies` runs them before anything touches those blocks. The cluster
store is not the engine's (engine/ imports no transport): a node looks blocks up there and `import_blocks` writes
what it found into the host tier, where the next prefix lookup finds it; when a request is done the node reads its
blocks with `export_blocks` and puts them in the store. Blocks cross this door as (hash, token ids, bytes): the
token ids are checked against the request's, as every prefix hit is.

One rank only for now: with tensor parallelism each rank holds a slice of every block, and the copies would have
to run on every rank (refused at start-up, engine/llm_engine.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.cache.host_tier import HostTier
from engine.cache.kv_cache_manager import KVCacheManager
from engine.hashing import BlockHash
from engine.host_kv_pool import HostKVPool

logger = logging.getLogger(__name__)

BlockKey = tuple[BlockHash, Sequence[int]]  # a full block's chained hash and its token ids


@dataclass(frozen=True)
class HostTierStats:
    num_slots: int
    num_used: int
    num_spilled: int
    num_loaded: int
    num_imported: int
    num_evicted: int
    query_tokens: int  # prompt tokens looked up here, past the pool's hits
    hit_tokens: int
    slot_bytes: int


class KVTiers:
    def __init__(self, kv: KVCacheManager, pool: torch.Tensor, num_bytes: int) -> None:
        """Adds a host tier of `num_bytes` below the KV manager's pool (`pool`: the engine's block-major KV pool)."""
        block_bytes = pool[0].numel() * pool.element_size()
        num_slots = num_bytes // block_bytes
        if num_slots < 1:
            raise ValueError(f"a host KV tier of {num_bytes} bytes holds no block of this model "
                             f"({block_bytes} bytes); give at least that")
        self.kv = kv
        self.host = HostTier(num_slots)
        self.host_pool = HostKVPool(num_slots, pool)
        kv.attach_host_tier(self.host)
        logger.info("host KV tier: %d blocks, %.2f GiB%s", num_slots, self.host_pool.num_bytes / 2**30,
                    " (pinned)" if self.host_pool.on_gpu else "")

    @property
    def block_bytes(self) -> int:
        return self.host_pool.block_bytes

    def run_copies(self, wait: bool = False) -> None:
        """Runs the copies the KV manager planned; with `wait`, until they are done (before a transfer writes pool
        blocks outside the device's stream order)."""
        copies = self.kv.take_copies()
        if copies:
            self.host_pool.run(copies)
        if wait:
            self.host_pool.sync()

    def num_local_blocks(self, blocks: Sequence[BlockKey]) -> int:
        """How many leading blocks of a prefix the pool or the host tier holds. It only reads dicts, so a node may
        ask off the engine thread (node_common/store_tier.py): the answer is then a hint, possibly stale."""
        for index, (block_hash, token_ids) in enumerate(blocks):
            if self.kv.pool.lookup(block_hash, token_ids) is None and block_hash not in self.host:
                return index
        return len(blocks)

    def import_blocks(self, blocks: Sequence[tuple[BlockHash, Sequence[int], bytes]]) -> int:
        """Writes blocks found elsewhere into the host tier (a wrong size stops there); how many it took."""
        self.run_copies(wait=True)  # no copy may still read or write a slot the host writes now
        num = 0
        for block_hash, token_ids, data in blocks:
            if len(data) != self.block_bytes:
                logger.warning("a KV block of %d bytes offered, this pool's are %d: ignored", len(data),
                               self.block_bytes)
                break
            slot = self.host.reserve(block_hash, token_ids)
            if slot is None:  # already here, or every slot busy
                if block_hash in self.host:
                    num += 1
                    continue
                break
            self.host_pool.write(slot, data)
            self.host.stats.num_imported += 1
            num += 1
        return num

    def export_blocks(self, blocks: Sequence[BlockKey]) -> list[bytes | None]:
        """The bytes of each block, from the pool or the host tier; None for one held in neither (evicted)."""
        self.run_copies(wait=True)
        out: list[bytes | None] = []
        for block_hash, token_ids in blocks:
            block_id = self.kv.pool.lookup(block_hash, token_ids)
            if block_id is not None:
                out.append(self.host_pool.read_block(block_id))
                continue
            slot = self.host.lookup(block_hash, token_ids)
            out.append(None if slot is None else self.host_pool.read(slot))
        return out

    def stats(self) -> HostTierStats:
        s = self.host.stats
        return HostTierStats(num_slots=self.host.num_slots, num_used=self.host.num_used, num_spilled=s.num_spilled,
                             num_loaded=s.num_loaded, num_imported=s.num_imported, num_evicted=s.num_evicted,
                             query_tokens=self.kv.num_host_queried_tokens, hit_tokens=self.kv.num_host_hit_tokens,
                             slot_bytes=self.block_bytes)
