"""The host tier's index: which full KV blocks a bounded host-memory pool holds, by block hash, LRU.

The second tier below a rank's KV pool (docs/architecture.md#kv-tiers). A cached block the pool evicts is copied
("spilled") to a host slot instead of vanishing; a later prefix lookup that runs past the pool's hits continues
here, and each hit is copied back ("loaded") into a fresh pool block before the step that reads it. Blocks that
come from the cluster store (node_common/store_tier.py) land here too, put by the node before it adds a request.

Torch-free: the slots' bytes are engine/host_kv_pool.py's. Invariants:
- `_slots` maps each held hash to its slot, least recently used first; `_free` holds the other slots;
- a slot that a planned copy still reads or writes is pinned (`pin`) until the copy has run (`unpin`): eviction
  skips it, so a step's spill never overwrites the source of its own load;
- a hit is verified against the block's token ids, never trusted to the hash alone (as in the pool).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engine.cache.block_pool import KVEvent, KVEventKind
from engine.hashing import BlockHash


@dataclass
class HostTierStats:
    """Counted in blocks; the node turns them into /metrics (engine/llm_engine.py EngineStats)."""

    num_spilled: int = 0  # blocks copied in from the pool
    num_imported: int = 0  # blocks written in from outside (the cluster store)
    num_loaded: int = 0  # blocks copied back to the pool on a hit
    num_evicted: int = 0  # blocks dropped to make room


class HostTier:
    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"the host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()
        self._tokens: dict[int, tuple[int, ...]] = {}
        self._free = list(range(num_slots - 1, -1, -1))
        self._pins: Counter[int] = Counter()
        self.stats = HostTierStats()
        self.events: list[KVEvent] | None = None  # as BlockPool.events, for this tier's prefixes

    @property
    def num_used(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slots

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> int | None:
        """The slot holding this block, now the most recently used; None when it is not here."""
        slot = self._slots.get(block_hash)
        if slot is None or self._tokens[slot] != tuple(token_ids):
            return None
        self._slots.move_to_end(block_hash)
        return slot

    def reserve(self, block_hash: BlockHash, token_ids: Sequence[int]) -> int | None:
        """A slot to write this block into, evicting the least recently used unpinned block if none is free.
        None when the block is already here (it is refreshed instead) or every slot is pinned."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return None
        slot = self._free.pop() if self._free else self._evict_one()
        if slot is None:
            return None
        self._slots[block_hash] = slot
        self._tokens[slot] = tuple(token_ids)
        if self.events is not None:
            self.events.append(KVEvent(KVEventKind.STORED, block_hash))
        return slot

    def discard(self, block_hash: BlockHash) -> None:
        """Forgets a block (its bytes were found bad): its slot is free again unless a copy still pins it."""
        slot = self._slots.pop(block_hash, None)
        if slot is None:
            return
        del self._tokens[slot]
        if self.events is not None:
            self.events.append(KVEvent(KVEventKind.REMOVED, block_hash))
        if not self._pins[slot]:
            self._free.append(slot)

    def pin(self, slot: int) -> None:
        self._pins[slot] += 1

    def unpin(self, slot: int) -> None:
        self._pins[slot] -= 1
        if self._pins[slot] <= 0:
            del self._pins[slot]
            if slot not in self._tokens and slot not in self._free:  # discarded while pinned
                self._free.append(slot)

    def cached_hashes(self) -> list[BlockHash]:
        return list(self._slots)

    def _evict_one(self) -> int | None:
        for block_hash, slot in self._slots.items():  # least recently used first
            if not self._pins[slot]:
                del self._slots[block_hash]
                del self._tokens[slot]
                self.stats.num_evicted += 1
                if self.events is not None:
                    self.events.append(KVEvent(KVEventKind.REMOVED, block_hash))
                return slot
        return None
