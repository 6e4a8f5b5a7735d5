"""The pool of KV blocks of one rank: reference counts, the prefix-cache map and LRU eviction.

Invariants:
- a block is in `_free` iff its ref_count is 0; `_free` is ordered least recently freed first, so eviction
  takes the coldest block;
- a free block may still hold a cached prefix (its hash is in `_cached`) until it is handed out again;
- `_cached[h]` is a block whose hash is h; the block also keeps its token ids, so a hit is verified, not
  trusted to the hash;
- when `events` is a list, every hash that becomes findable in `_cached` appends STORED and every hash that
  stops being findable appends REMOVED, in order: replaying them gives the set of `_cached`'s keys (what a
  node publishes for the proxy's prefix index).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.hashing import BlockHash


class KVEventKind(enum.Enum):
    STORED = "stored"  # the prefix `block_hash` can now be found in this pool
    REMOVED = "removed"  # it no longer can (its block was handed out again or the cache was reset)


@dataclass(frozen=True)
class KVEvent:
    kind: KVEventKind
    block_hash: BlockHash


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self.events: list[KVEvent] | None = None  # None: nobody listens, record nothing
        # None: nobody keeps evicted blocks; else allocate() appends (block id, hash, token ids) of each cached block
        # it hands out again, before that block is written (the host tier copies it out first)
        self.evicted: list[tuple[int, BlockHash, tuple[int, ...]]] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, num: int) -> list[int]:
        """Hands out `num` free blocks, evicting the cached prefixes they held."""
        if num > self.num_free:
            raise RuntimeError(f"asked for {num} KV blocks, {self.num_free} free")
        ids = []
        for _ in range(num):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if self.evicted is not None and block.block_hash is not None and block.token_ids is not None:
                self.evicted.append((block_id, block.block_hash, block.token_ids))
            self._evict(block)
            block.ref_count = 1
            ids.append(block_id)
        return ids

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> int | None:
        block_id = self._cached.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != tuple(token_ids):
            return None
        return block_id

    def touch(self, block_ids: Iterable[int]) -> None:
        """Takes a reference to cached blocks found by lookup (taking them off the free list if needed)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops a reference. Pass a sequence's blocks tail first: its tail is then evicted before its head,
        which other sequences are more likely to share."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed more often than taken"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def cache(self, block_id: int, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        """Marks a full, computed block as holding the prefix `block_hash`."""
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        # an equal block may already be cached (two sequences computed the same prefix at once): keep the first
        if self._cached.setdefault(block_hash, block_id) == block_id and self.events is not None:
            self.events.append(KVEvent(KVEventKind.STORED, block_hash))

    def cached_hashes(self) -> list[BlockHash]:
        """Every prefix this pool can find now (a full snapshot, for listeners that lost events)."""
        return list(self._cached)

    def is_evictable(self, block_id: int) -> bool:
        return self.blocks[block_id].ref_count == 0

    def reset_prefix_cache(self) -> None:
        for block_id in self._free:
            self._evict(self.blocks[block_id])

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
            if self.events is not None:
                self.events.append(KVEvent(KVEventKind.REMOVED, block.block_hash))
        block.block_hash = None
        block.token_ids = None
