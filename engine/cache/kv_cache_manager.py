"""Block tables of requests over the block pool, with prefix caching and (optionally) the host tier below it.

For a request, the KV manager keeps `request.block_ids` covering at least `num_computed_tokens + num_new`
tokens, and `request.block_hashes` for its full blocks:

    tokens:    |<----- num_computed_tokens ----->|<-- scheduled -->|<-- not yet -->|
    blocks:    | cached/full | cached/full | ... | allocated ...   |
    hashed:    only blocks whose tokens are all computed

With a host tier (engine/cache/host_tier.py), the cached blocks the pool hands out again are spilled to it, and a
prefix lookup continues there past the pool's hits. Both are copies the manager only plans: `take_copies()` gives
them to the engine, which runs them before the next step reads or writes those blocks (spills first: a block just
spilled may be the target of a load in the same plan).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.cache.block_pool import BlockPool
from engine.cache.host_tier import HostTier
from engine.hashing import block_hashes
from engine.request import Request


@dataclass(frozen=True)
class PrefixHit:
    """The longest known prefix of a request: pool blocks first, then host-tier slots after them."""

    blocks: list[int] = field(default_factory=list)
    host_slots: list[int] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks) + len(self.host_slots)


NO_HIT = PrefixHit()


@dataclass
class KVCopies:
    """Copies between the pool and the host tier, in the order they must run."""

    spills: list[tuple[int, int]] = field(default_factory=list)  # (pool block, host slot)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, pool block)

    def __bool__(self) -> bool:
        return bool(self.spills or self.loads)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, hash_seed: str) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0  # found in the pool
        self.num_host_queried_tokens = 0  # looked up in the host tier (past the pool's hits)
        self.num_host_hit_tokens = 0  # found in the host tier
        self.host: HostTier | None = None
        self._copies = KVCopies()

    def attach_host_tier(self, host: HostTier) -> None:
        """Puts a host tier below the pool (without prefix caching there is nothing to keep: it stays unused)."""
        if self.enable_prefix_caching:
            self.host = host
            self.pool.evicted = []

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> PrefixHit:
        """The longest cached prefix of the request: blocks of the pool, then slots of the host tier.

        At most len-1 tokens: even a full hit recomputes the last token, whose logits are needed."""
        if not self.enable_prefix_caching:
            return NO_HIT
        self._hash_full_blocks(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        slots: list[int] = []
        for index, block_hash in enumerate(request.block_hashes[:max_blocks]):
            begin = index * self.block_size
            tokens = request.token_ids[begin:begin + self.block_size]
            block_id = None if slots else self.pool.lookup(block_hash, tokens)
            if block_id is not None:
                blocks.append(block_id)
                continue
            slot = None if self.host is None else self.host.lookup(block_hash, tokens)
            if slot is None:
                break
            slots.append(slot)
        return PrefixHit(blocks, slots)

    def record_lookup(self, num_tokens: int, hit: PrefixHit) -> None:
        """Counts a prefix-cache lookup whose request was admitted (a lookup retried while the pool is full
        counts once, when it succeeds)."""
        if self.enable_prefix_caching:
            self.num_queried_tokens += num_tokens
            self.num_hit_tokens += len(hit.blocks) * self.block_size
            if self.host is not None:
                self.num_host_queried_tokens += num_tokens - len(hit.blocks) * self.block_size
            self.num_host_hit_tokens += len(hit.host_slots) * self.block_size

    def allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        """Makes request.block_ids cover num_computed_tokens + num_new_tokens (the hit's blocks first; its host
        slots are loaded into the first new blocks, by the next copies).

        Returns False, changing nothing, when the pool cannot supply the blocks."""
        num_computed = request.num_computed_tokens + hit.num_blocks * self.block_size
        num_needed = self.blocks_needed(num_computed + num_new_tokens) - len(request.block_ids) - len(hit.blocks)
        # cached blocks sitting on the free list stop being free once taken
        num_reclaimed = sum(1 for b in hit.blocks if self.pool.is_evictable(b))
        if num_needed > self.pool.num_free - num_reclaimed:
            return False
        if hit.blocks:
            self.pool.touch(hit.blocks)
            request.block_ids.extend(hit.blocks)
        request.num_computed_tokens = num_computed
        if num_needed > 0:
            for slot in hit.host_slots:  # before the spills below can make room in the host tier
                assert self.host is not None
                self.host.pin(slot)
            new_blocks = self.pool.allocate(num_needed)
            self._spill_evicted()
            for slot, block_id in zip(hit.host_slots, new_blocks, strict=False):
                self._copies.loads.append((slot, block_id))
            if self.host is not None:
                self.host.stats.num_loaded += len(hit.host_slots)
            request.block_ids.extend(new_blocks)
        return True

    def take_copies(self) -> KVCopies:
        """The copies planned since the last call; the caller runs them before anything else touches those
        blocks or slots (the next step, a transfer into reserved blocks, a write into the host tier)."""
        copies, self._copies = self._copies, KVCopies()
        if self.host is not None:
            for _, slot in copies.spills:
                self.host.unpin(slot)
            for slot, _ in copies.loads:
                self.host.unpin(slot)
        return copies

    def _spill_evicted(self) -> None:
        """Plans a copy to the host tier of each cached block the pool just handed out again."""
        evicted = self.pool.evicted
        if self.host is None or not evicted:
            return
        for block_id, block_hash, token_ids in evicted:
            slot = self.host.reserve(block_hash, token_ids)
            if slot is not None:
                self.host.pin(slot)
                self._copies.spills.append((block_id, slot))
                self.host.stats.num_spilled += 1
        evicted.clear()

    def cache_computed_blocks(self, request: Request, num_computed_tokens: int | None = None) -> None:
        """Registers the request's newly completed full blocks in the prefix cache: those within its first
        `num_computed_tokens` (default: all of request.num_computed_tokens, which may count a step still to run).
        """
        if not self.enable_prefix_caching:
            return
        num_computed = request.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        num_full = num_computed // self.block_size
        self._hash_full_blocks(request)
        for index in range(request.num_cached_blocks, num_full):
            begin = index * self.block_size
            self.pool.cache(request.block_ids[index], request.block_hashes[index],
                            request.token_ids[begin:begin + self.block_size])
        request.num_cached_blocks = max(request.num_cached_blocks, num_full)

    def free(self, request: Request) -> None:
        self.pool.free(reversed(request.block_ids))
        request.block_ids = []
        request.num_cached_blocks = 0

    def _hash_full_blocks(self, request: Request) -> None:
        have = len(request.block_hashes)
        if (have + 1) * self.block_size > request.num_tokens:
            return
        parent = request.block_hashes[-1] if have else None
        request.block_hashes.extend(
            block_hashes(request.token_ids, self.block_size, self.hash_seed, start=have, parent=parent))
