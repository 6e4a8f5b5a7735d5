"""The proxy's prefix index, and what feeds it: the block pool's KV events and the registry's wire format."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.cache.block_pool import BlockPool, KVEvent, KVEventKind
from engine.cache.kv_cache_manager import KVCacheManager
from engine.hashing import block_hashes
from engine.request import Request
from engine.types import SamplingParams
from node_common.registrar import coalesce
from proxy.routing.prefix_index import PrefixIndex
from wire import KVDelta, NodeCapacity, NodeLoad, NodeRecord, Role, hash_fingerprint

ROOT = Path(__file__).resolve().parents[2]
H = [bytes([i]) * 16 for i in range(8)]  # stand-ins for chained hashes


# ---- the index ----
def test_match_counts_each_nodes_leading_run_of_blocks() -> None:
    index = PrefixIndex()
    index.store("a", H[:4])
    index.store("b", H[:2])
    index.store("c", [H[1], H[2]])  # holds later blocks but not the first: an engine could reuse none
    assert index.match(H[:5]) == {"a": 4, "b": 2}
    assert index.match(H[:5], node_ids=["b", "c"]) == {"b": 2}
    assert index.match([H[7]]) == {} and index.match([]) == {}


def test_a_gap_ends_a_nodes_run_even_when_later_blocks_are_held() -> None:
    index = PrefixIndex()
    index.store("a", H[:6])
    index.remove("a", [H[2]])  # evicted from the middle
    assert index.match(H[:6]) == {"a": 2}


def test_replace_and_drop_node_leave_no_trace_of_the_old_content() -> None:
    index = PrefixIndex()
    index.store("a", H[:3])
    index.store("b", H[:3])
    index.replace("a", [H[5]])
    assert index.match(H[:3]) == {"b": 3} and index.num_blocks("a") == 1 and index.holds("a", H[5])
    index.drop_node("b")
    assert index.match(H[:3]) == {} and index.node_ids == {"a"}
    index.remove("unknown", H)  # harmless
    index.drop_node("a")
    assert index.node_ids == set() and index.match([H[5]]) == {}


# ---- the pool's events ----
def test_pool_records_nothing_unless_someone_listens() -> None:
    pool = BlockPool(2)
    pool.cache(pool.allocate(1)[0], H[0], [1])
    assert pool.events is None


def test_pool_events_replay_to_the_set_of_findable_prefixes() -> None:
    pool = BlockPool(3)
    pool.events = []
    ids = pool.allocate(3)
    for i, block_id in enumerate(ids):
        pool.cache(block_id, H[i], [i])
    pool.cache(ids[0], H[0], [0])  # already cached: no second event
    pool.free(ids)
    extra = pool.allocate(2)  # evicts H[0] and H[1], least recently freed first
    pool.cache(extra[0], H[3], [3])
    pool.free(extra)
    pool.reset_prefix_cache()  # everything free is evicted
    kinds = [(e.kind, e.block_hash) for e in pool.events]
    assert kinds == [(KVEventKind.STORED, H[0]), (KVEventKind.STORED, H[1]), (KVEventKind.STORED, H[2]),
                     (KVEventKind.REMOVED, H[0]), (KVEventKind.REMOVED, H[1]), (KVEventKind.STORED, H[3]),
                     (KVEventKind.REMOVED, H[2]), (KVEventKind.REMOVED, H[3])]
    assert pool.cached_hashes() == []


def test_a_duplicate_block_does_not_announce_its_hash_twice() -> None:
    pool = BlockPool(3)
    pool.events = []
    a, b = pool.allocate(2)
    pool.cache(a, H[0], [7])
    pool.cache(b, H[0], [7])  # two sequences computed the same prefix at once: the first stays findable
    pool.free([b])
    pool.allocate(2)  # hands out the free block 2 and b: b was never the findable one
    assert [e.kind for e in pool.events] == [KVEventKind.STORED] and pool.cached_hashes() == [H[0]]


def test_the_kv_manager_announces_prompt_blocks_by_their_chained_hashes() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True, hash_seed="s")
    kv.pool.events = []
    request = Request("r", list(range(10)), SamplingParams())
    assert kv.allocate(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)
    stored = [e.block_hash for e in kv.pool.events if e.kind is KVEventKind.STORED]
    assert stored == block_hashes(list(range(10)), 4, "s")  # what the proxy computes for this prompt


# ---- the wire format ----
def test_coalesce_keeps_each_hashes_last_event() -> None:
    events = [KVEvent(KVEventKind.STORED, H[0]), KVEvent(KVEventKind.STORED, H[1]),
              KVEvent(KVEventKind.REMOVED, H[0]), KVEvent(KVEventKind.REMOVED, H[2]),
              KVEvent(KVEventKind.STORED, H[2])]
    stored, removed = coalesce(events)
    assert sorted(stored) == sorted([H[1].hex(), H[2].hex()]) and removed == [H[0].hex()]


def test_records_and_deltas_survive_the_round_trip() -> None:
    record = NodeRecord("d-1", Role.DECODE, "10.0.0.1:5000", "/models/m", "abc", "nixl", 42, hash_fingerprint("s"),
                        NodeCapacity(64, 8, 2048, 4), NodeLoad(60, 1, 2, 30), draining=True, updated_at=1.5)
    assert NodeRecord.from_json(record.to_json()) == record
    delta = KVDelta("d-1", 3, (H[0].hex(),), (H[1].hex(), H[2].hex()))
    assert KVDelta.from_fields(delta.to_fields()) == delta
    assert KVDelta.from_fields({"node": "d-1", "seq": "0", "stored": "", "removed": ""}) == KVDelta("d-1", 0)
    assert hash_fingerprint("s") != hash_fingerprint("t")


@pytest.mark.parametrize("text", ["{}", "not json", '{"version": 99}', '{"version": 1, "role": "x"}'])
def test_a_malformed_record_is_a_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        NodeRecord.from_json(text)


def test_the_proxys_routing_modules_import_no_torch() -> None:
    code = ("import sys, proxy.routing.prefix_index, proxy.routing.router, proxy.routing.directory, proxy.routing.pd, "
            "proxy.api.metrics, protos.convert, "
            "node_common.registrar, node_common.load; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
