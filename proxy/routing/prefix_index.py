"""Which KV blocks each node can reuse, and from which tier, by chained block hash (fed by the nodes' KV events).

A chained hash names a block *and* everything before it, so a node holding block i of a prompt holds that
prefix's content in block i; but eviction is per block, so it may have lost some of blocks 0..i-1. An
engine reuses only the leading run of hits from block 0, hence a lookup counts, per node, how many of the
prompt's first blocks it can reuse without a gap. The index is a hint for routing: a stale entry costs a
recompute, never a wrong answer (a node verifies every hit against the block's token ids).

Three tiers (docs/architecture.md#kv-tiers), and the run a node's engine reuses across them:

    blocks of a prompt:  | device ... device | host or store ... host or store | miss ...
                           the pool's hits     loaded into fresh pool blocks

- device: the node's pool. Its hits come first: once the engine's lookup has left the pool it does not return
  (engine/cache/kv_cache_manager.py find_cached_prefix), so a block only in the pool after that ends the run.
- host: the node's host tier; the lookup continues there past the pool's hits.
- store: the cluster store of the node's KV layout, shared by every node of that layout. A node gets the blocks
  past those it holds before adding the prompt, into its host tier, so a store block continues the run like a
  host block (a block in both counts as host: no get needed). The store evicts silently, so its entries are hints
  that expire (wire.registry STORE_HINT_TTL_S, STORE_HINT_MAX_BLOCKS).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

from engine.hashing import BlockHash
from wire.registry import STORE_HINT_MAX_BLOCKS, STORE_HINT_TTL_S, Tier

NODE_TIERS = (Tier.DEVICE, Tier.HOST)  # the tiers a node holds itself (the store is its layout's)


class PrefixMatch(NamedTuple):
    """One node's reusable leading run of a prompt's blocks, by tier, in the order the engine reuses them."""

    num_device: int = 0
    num_host: int = 0  # after the device run
    num_store: int = 0  # after the device run, interleaved with the host blocks, in none of the node's own tiers

    @property
    def num_blocks(self) -> int:
        return self.num_device + self.num_host + self.num_store


class PrefixIndex:
    def __init__(self, store_ttl_s: float = STORE_HINT_TTL_S, max_store_blocks: int = STORE_HINT_MAX_BLOCKS,
                 clock: Callable[[], float] = time.time) -> None:
        """`clock`: unix time, the clock the nodes stamp their store puts with (wire.registry)."""
        self._held: dict[str, dict[Tier, set[BlockHash]]] = {}  # node id -> its tiers -> their hashes
        # layout hash -> hash -> unix time of its latest put, oldest first
        self._in_store: dict[str, OrderedDict[BlockHash, float]] = {}
        self.store_ttl_s = store_ttl_s
        self.max_store_blocks = max_store_blocks
        self._clock = clock

    # ---- a node's own tiers ----
    def store(self, node_id: str, hashes: Iterable[BlockHash], tier: Tier = Tier.DEVICE) -> None:
        self._tier(node_id, tier).update(hashes)

    def remove(self, node_id: str, hashes: Iterable[BlockHash], tier: Tier = Tier.DEVICE) -> None:
        held = self._held.get(node_id, {}).get(tier)
        if held is not None:
            held.difference_update(hashes)

    def replace(self, node_id: str, hashes: Iterable[BlockHash], tier: Tier = Tier.DEVICE) -> None:
        """Sets the whole content of one of a node's tiers (a snapshot)."""
        self._tier(node_id, tier).clear()
        self.store(node_id, hashes, tier)

    def drop_node(self, node_id: str) -> None:
        """Forgets a node's own tiers (what it put in the store stays: other nodes of its layout can get it)."""
        self._held.pop(node_id, None)

    def num_blocks(self, node_id: str, tier: Tier = Tier.DEVICE) -> int:
        return len(self._held.get(node_id, {}).get(tier, ()))

    def holds(self, node_id: str, block_hash: BlockHash, tier: Tier = Tier.DEVICE) -> bool:
        return block_hash in self._held.get(node_id, {}).get(tier, ())

    @property
    def node_ids(self) -> set[str]:
        return set(self._held)

    def _tier(self, node_id: str, tier: Tier) -> set[BlockHash]:
        assert tier in NODE_TIERS, f"tier {tier.value} is not a node's own: add_store_blocks"
        return self._held.setdefault(node_id, {}).setdefault(tier, set())

    # ---- the store of a layout ----
    def add_store_blocks(self, layout_hash: str, puts: Iterable[tuple[BlockHash, float]]) -> None:
        """Blocks nodes of this layout put in the store, each with the unix time of its put. The oldest entries
        beyond `max_store_blocks` and those older than `store_ttl_s` are forgotten."""
        entries = self._in_store.setdefault(layout_hash, OrderedDict())
        for block_hash, put_at in puts:
            if put_at >= entries.get(block_hash, put_at):  # a snapshot may carry an older put than an event
                entries[block_hash] = put_at
                entries.move_to_end(block_hash)
        expired_before = self._clock() - self.store_ttl_s
        while entries and (len(entries) > self.max_store_blocks or next(iter(entries.values())) <= expired_before):
            entries.popitem(last=False)
        if not entries:
            del self._in_store[layout_hash]

    def num_store_blocks(self, layout_hash: str) -> int:
        """Entries kept for a layout, expired ones not yet pruned included."""
        return len(self._in_store.get(layout_hash, ()))

    # ---- lookups ----
    def match(self, hashes: Sequence[BlockHash], nodes: Mapping[str, str] | None = None) -> dict[str, PrefixMatch]:
        """Per node, its leading run of `hashes` across its tiers; nodes with none are left out.

        `nodes` maps the node ids to consider to their KV layout hash, whose store they can get blocks from ("":
        none). None: every node with blocks of its own, credited with no store."""
        candidates = nodes if nodes is not None else dict.fromkeys(self._held, "")
        fresh_after = self._clock() - self.store_ttl_s
        matches: dict[str, PrefixMatch] = {}
        for node_id, layout_hash in candidates.items():
            own = self._held.get(node_id, {})
            device, host = own.get(Tier.DEVICE, set()), own.get(Tier.HOST, set())
            in_store: Mapping[BlockHash, float] = self._in_store.get(layout_hash, {}) if layout_hash else {}
            num_device = num_host = num_store = 0
            for block_hash in hashes:
                if num_host == num_store == 0 and block_hash in device:
                    num_device += 1
                elif block_hash in host:
                    num_host += 1
                elif in_store.get(block_hash, fresh_after) > fresh_after:
                    num_store += 1
                else:
                    break
            if num_device or num_host or num_store:
                matches[node_id] = PrefixMatch(num_device, num_host, num_store)
        return matches
