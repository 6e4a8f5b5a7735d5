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
from proxy.routing.prefix_index import PrefixIndex, PrefixMatch
from wire import KVDelta, NodeCapacity, NodeLoad, NodeRecord, Role, hash_fingerprint
from wire.registry import Tier, kv_set_key, store_set_key

ROOT = Path(__file__).resolve().parents[2]
H = [bytes([i]) * 16 for i in range(8)]  # stand-ins for chained hashes


# ---- the index ----
def test_match_counts_each_nodes_leading_run_of_blocks() -> None:
    index = PrefixIndex()
    index.store("a", H[:4])
    index.store("b", H[:2])
    index.store("c", [H[1], H[2]])  # holds later blocks but not the first: an engine could reuse none
    assert index.match(H[:5]) == {"a": PrefixMatch(4), "b": PrefixMatch(2)}
    assert index.match(H[:5], {"b": "", "c": ""}) == {"b": PrefixMatch(2)}
    assert index.match([H[7]]) == {} and index.match([]) == {}


def test_a_gap_ends_a_nodes_run_even_when_later_blocks_are_held() -> None:
    index = PrefixIndex()
    index.store("a", H[:6])
    index.remove("a", [H[2]])  # evicted from the middle
    assert index.match(H[:6]) == {"a": PrefixMatch(2)}


def test_replace_and_drop_node_leave_no_trace_of_the_old_content() -> None:
    index = PrefixIndex()
    index.store("a", H[:3])
    index.store("b", H[:3])
    index.replace("a", [H[5]])
    assert index.match(H[:3]) == {"b": PrefixMatch(3)} and index.num_blocks("a") == 1 and index.holds("a", H[5])
    index.drop_node("b")
    assert index.match(H[:3]) == {} and index.node_ids == {"a"}
    index.remove("unknown", H)  # harmless
    index.drop_node("a")
    assert index.node_ids == set() and index.match([H[5]]) == {}


# ---- tiers ----
def test_a_nodes_run_is_its_device_blocks_then_host_blocks_continuing_them() -> None:
    index = PrefixIndex()
    index.store("a", H[:2])
    index.store("a", H[2:4], Tier.HOST)
    index.store("b", H[:4], Tier.HOST)  # host only: the run starts in the host tier
    index.store("c", [H[0], H[2]])
    index.store("c", [H[1]], Tier.HOST)  # the engine does not return to the pool after a host hit
    index.store("d", H[:3])
    index.store("d", H[1:3], Tier.HOST)  # in both: the pool's hit counts as device
    assert index.match(H[:6]) == {"a": PrefixMatch(2, 2), "b": PrefixMatch(0, 4), "c": PrefixMatch(1, 1),
                                  "d": PrefixMatch(3)}
    assert index.match(H[:6])["a"].num_blocks == 4


def test_tiers_of_a_node_are_updated_and_replaced_apart() -> None:
    index = PrefixIndex()
    index.store("a", H[:3])
    index.store("a", H[3:5], Tier.HOST)
    index.remove("a", [H[3]])  # not in the device tier: no effect on the host one
    assert index.match(H[:5]) == {"a": PrefixMatch(3, 2)}
    index.replace("a", [H[0]], Tier.HOST)
    assert index.num_blocks("a") == 3 and index.num_blocks("a", Tier.HOST) == 1
    assert index.holds("a", H[0], Tier.HOST) and not index.holds("a", H[4], Tier.HOST)
    index.remove("a", [H[1]])
    assert index.match(H[:5]) == {"a": PrefixMatch(1)}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_store_blocks_continue_the_run_of_every_node_of_their_layout() -> None:
    index = PrefixIndex(clock=Clock())
    index.store("p1", H[:2])  # computed the earlier prompt
    index.add_store_blocks("L", [(h, 1000.0) for h in H[:4]])  # prompt and answer, put by their nodes
    index.store("p1", [H[3]], Tier.HOST)
    nodes = {"p1": "L", "p2": "L", "q": "other", "s": ""}  # q: another layout; s: no store
    assert index.match(H[:6], nodes) == {"p1": PrefixMatch(2, 1, 1), "p2": PrefixMatch(0, 0, 4)}
    assert index.match(H[:6]) == {"p1": PrefixMatch(2)}  # no layouts given: no store credit
    index.drop_node("p1")  # a node that leaves takes its own tiers, not what it put in the store
    assert index.match(H[:6], nodes) == {"p1": PrefixMatch(0, 0, 4), "p2": PrefixMatch(0, 0, 4)}


def test_store_entries_are_hints_that_expire_and_are_bounded() -> None:
    clock = Clock()
    index = PrefixIndex(store_ttl_s=60.0, max_store_blocks=3, clock=clock)
    index.add_store_blocks("L", [(H[0], 1000.0), (H[1], 1000.0)])
    clock.now = 1030.0
    index.add_store_blocks("L", [(H[0], 1030.0), (H[2], 1030.0), (H[0], 990.0)])  # an older put changes nothing
    clock.now = 1061.0  # H[1] is 61 s old, H[0] and H[2] 31 s
    assert index.match(H[:3], {"n": "L"}) == {"n": PrefixMatch(0, 0, 1)}
    index.add_store_blocks("L", [(H[3], 1061.0)])  # prunes the expired H[1]
    assert index.num_store_blocks("L") == 3
    index.add_store_blocks("L", [(H[4], 1061.0)])  # four entries: the oldest put (H[0]) goes
    assert index.num_store_blocks("L") == 3 and index.match([H[0]], {"n": "L"}) == {}
    clock.now = 2000.0
    assert index.match([H[2]], {"n": "L"}) == {}
    index.add_store_blocks("L", [])
    assert index.num_store_blocks("L") == 0


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


@pytest.mark.parametrize("tier", list(Tier))
def test_a_delta_keeps_its_tier_over_the_wire(tier: Tier) -> None:
    delta = KVDelta("d-1", 4, (H[0].hex(), H[1].hex()), (), tier)
    fields = delta.to_fields()
    assert fields["tier"] == tier.value and KVDelta.from_fields(fields) == delta


def test_an_entry_without_a_tier_is_of_the_device_tier() -> None:
    old = {"node": "d-1", "seq": "2", "stored": H[0].hex(), "removed": ""}  # written by a node without tiers
    assert KVDelta.from_fields(old) == KVDelta("d-1", 2, (H[0].hex(),), (), Tier.DEVICE)
    with pytest.raises(ValueError):
        KVDelta.from_fields({**old, "tier": "tape"})


def test_each_tier_has_its_own_set_and_the_device_set_keeps_its_key() -> None:
    assert kv_set_key("n") == kv_set_key("n", Tier.DEVICE) == "tandem:kv:n"
    keys = {kv_set_key("n"), kv_set_key("n", Tier.HOST), store_set_key("n")}
    assert len(keys) == 3 and kv_set_key("host:n") not in keys  # node ids cannot collide with a tier's key


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
