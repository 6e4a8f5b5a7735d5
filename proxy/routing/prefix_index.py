"""Which node's prefix cache holds which KV blocks, by chained block hash (fed by the nodes' KV events).

A chained hash names a block *and* everything before it, so a node holding block i of a prompt holds that
prefix's content in block i; but eviction is per block, so it may have lost some of blocks 0..i-1. An
engine reuses only the leading run of hits from block 0, hence a lookup counts, per node, how many of the
prompt's first blocks it holds without a gap. The index is a hint for routing: a stale entry costs a
recompute, never a wrong answer (a node verifies every hit against the block's token ids).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from engine.hashing import BlockHash


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[BlockHash, set[str]] = {}  # hash -> ids of the nodes whose cache has it
        self._held: dict[str, set[BlockHash]] = {}  # node id -> its hashes (to drop a node at once)

    def store(self, node_id: str, hashes: Iterable[BlockHash]) -> None:
        held = self._held.setdefault(node_id, set())
        for block_hash in hashes:
            held.add(block_hash)
            self._holders.setdefault(block_hash, set()).add(node_id)

    def remove(self, node_id: str, hashes: Iterable[BlockHash]) -> None:
        held = self._held.get(node_id)
        if held is None:
            return
        for block_hash in hashes:
            held.discard(block_hash)
            holders = self._holders.get(block_hash)
            if holders is not None:
                holders.discard(node_id)
                if not holders:
                    del self._holders[block_hash]

    def replace(self, node_id: str, hashes: Iterable[BlockHash]) -> None:
        """Sets a node's whole content (a snapshot)."""
        self.drop_node(node_id)
        self.store(node_id, hashes)

    def drop_node(self, node_id: str) -> None:
        self.remove(node_id, list(self._held.get(node_id, ())))
        self._held.pop(node_id, None)

    def num_blocks(self, node_id: str) -> int:
        return len(self._held.get(node_id, ()))

    def holds(self, node_id: str, block_hash: BlockHash) -> bool:
        return node_id in self._holders.get(block_hash, ())

    @property
    def node_ids(self) -> set[str]:
        return set(self._held)

    def match(self, hashes: Sequence[BlockHash], node_ids: Collection[str] | None = None) -> dict[str, int]:
        """Per node (of `node_ids`, default all), how many leading blocks of `hashes` it holds; nodes holding
        none are left out."""
        depth_of: dict[str, int] = {}
        alive: set[str] | None = None if node_ids is None else set(node_ids)
        for depth, block_hash in enumerate(hashes, start=1):
            holders = self._holders.get(block_hash)
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for node_id in alive:
                depth_of[node_id] = depth
        return depth_of
