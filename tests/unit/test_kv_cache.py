"""Block pool, chained hashes and the KV manager's prefix caching, without a model."""

from __future__ import annotations

import pytest

from engine.cache.block_pool import BlockPool
from engine.cache.kv_cache_manager import KVCacheManager
from engine.hashing import block_hashes, root_hash
from engine.request import Request
from engine.types import SamplingParams


def make_request(token_ids: list[int], request_id: str = "r") -> Request:
    return Request(request_id, token_ids, SamplingParams())


def test_hashes_chain_over_the_whole_prefix() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, "s")
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4, "s")
    assert len(a) == 2 and len(b) == 2  # only full blocks
    assert a[1] != b[1]  # same second block, different first: different hash
    assert block_hashes([1, 2, 3, 4], 4, "other")[0] != a[0]  # the seed separates clusters
    assert root_hash("s") != root_hash("t")
    extended = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4, "s", start=2, parent=a[1])
    assert a + extended == block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4, "s")


def test_pool_evicts_the_least_recently_freed_cached_block() -> None:
    pool = BlockPool(3)
    ids = pool.allocate(3)
    for i, block_id in enumerate(ids):
        pool.cache(block_id, bytes([i]), [i])
    pool.free([ids[1], ids[0], ids[2]])
    assert pool.lookup(bytes([0]), [0]) == ids[0]
    new = pool.allocate(1)
    assert new == [ids[1]] and pool.lookup(bytes([1]), [1]) is None  # evicted
    assert pool.lookup(bytes([2]), [2]) == ids[2]


def test_pool_verifies_token_ids_on_a_hash_hit() -> None:
    pool = BlockPool(1)
    (block_id,) = pool.allocate(1)
    pool.cache(block_id, b"h", [1, 2])
    assert pool.lookup(b"h", [1, 2]) == block_id
    assert pool.lookup(b"h", [1, 3]) is None


def test_pool_refuses_more_than_it_has() -> None:
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="2 free"):
        pool.allocate(3)


def test_manager_shares_cached_prefix_blocks_between_requests() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True, hash_seed="s")
    first = make_request(list(range(10)), "a")
    assert kv.allocate(first, 10)
    first.num_computed_tokens = 10
    kv.cache_computed_blocks(first)
    second = make_request(list(range(8)) + [99, 98, 97], "b")
    hits = kv.find_cached_prefix(second)
    assert hits.blocks == first.block_ids[:2] and not hits.host_slots
    assert kv.allocate(second, 3, hits)
    assert second.num_computed_tokens == 8 and second.block_ids[:2] == first.block_ids[:2]
    assert kv.pool.blocks[hits.blocks[0]].ref_count == 2
    kv.free(first)
    kv.free(second)
    assert kv.num_free_blocks == 8


def test_manager_counts_free_cached_blocks_it_would_reuse() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=2, enable_prefix_caching=True, hash_seed="s")
    first = make_request([1, 2, 3, 4, 5])
    assert kv.allocate(first, 5)
    first.num_computed_tokens = 5
    kv.cache_computed_blocks(first)
    kv.free(first)
    second = make_request([1, 2, 3, 4, 7, 8, 9, 10])  # 2 cached blocks, needs 2 more: only 1 left
    hits = kv.find_cached_prefix(second)
    assert hits.num_blocks == 2
    assert not kv.allocate(second, 4, hits)
    assert second.block_ids == [] and kv.num_free_blocks == 3  # nothing changed


def test_prefix_caching_off_finds_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False, hash_seed="s")
    r = make_request([1, 2, 3, 4, 5])
    assert kv.allocate(r, 5)
    r.num_computed_tokens = 5
    kv.cache_computed_blocks(r)
    assert kv.find_cached_prefix(make_request([1, 2, 3, 4, 5])).num_blocks == 0
