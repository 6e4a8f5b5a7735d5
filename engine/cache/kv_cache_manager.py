"""Block tables of requests over the block pool, with prefix caching.

For a request, the KV manager keeps `request.block_ids` covering at least `num_computed_tokens + num_new`
tokens, and `request.block_hashes` for its full blocks:

    tokens:    |<----- num_computed_tokens ----->|<-- scheduled -->|<-- not yet -->|
    blocks:    | cached/full | cached/full | ... | allocated ...   |
    hashed:    only blocks whose tokens are all computed
"""

from __future__ import annotations

from engine.cache.block_pool import BlockPool
from engine.hashing import block_hashes
from engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, hash_seed: str) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks holding the longest cached prefix of the request.

        At most len-1 tokens: even a full hit recomputes the last token, whose logits are needed."""
        if not self.enable_prefix_caching:
            return []
        self._hash_full_blocks(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for index, block_hash in enumerate(request.block_hashes[:max_blocks]):
            begin = index * self.block_size
            block_id = self.pool.lookup(block_hash, request.token_ids[begin:begin + self.block_size])
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counts a prefix-cache lookup whose request was admitted (a lookup retried while the pool is full
        counts once, when it succeeds)."""
        if self.enable_prefix_caching:
            self.num_queried_tokens += num_tokens
            self.num_hit_tokens += num_hit_tokens

    def allocate(self, request: Request, num_new_tokens: int, cached_blocks: list[int] | None = None) -> bool:
        """Makes request.block_ids cover num_computed_tokens + num_new_tokens (cached blocks first).

        Returns False, changing nothing, when the pool cannot supply the blocks."""
        cached_blocks = cached_blocks or []
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        num_needed = self.blocks_needed(num_computed + num_new_tokens) - len(request.block_ids) - len(cached_blocks)
        # cached blocks sitting on the free list stop being free once taken
        num_reclaimed = sum(1 for b in cached_blocks if self.pool.is_evictable(b))
        if num_needed > self.pool.num_free - num_reclaimed:
            return False
        if cached_blocks:
            self.pool.touch(cached_blocks)
            request.block_ids.extend(cached_blocks)
            request.num_computed_tokens = num_computed
        if num_needed > 0:
            request.block_ids.extend(self.pool.allocate(num_needed))
        return True

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
