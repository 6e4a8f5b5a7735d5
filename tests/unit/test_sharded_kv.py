"""Which heads each rank of a decode node reads from which prefill rank, and the head units that means: the
arithmetic of the head-major pool (engine/layers/attention.py), checked by hand."""

from __future__ import annotations

import pytest

from kvtransfer import KVLayout
from kvtransfer.errors import IncompatiblePeerError
from kvtransfer.handshake import decode_rank_set, encode_rank_set
from node_common.sharded_kv import plan_reads, unit_ids

BASE = {"model": "m", "dtype": "float32", "num_layers": 2, "num_kv_heads": 4, "head_dim": 16, "block_size": 4}


def ranks(tp_size: int, num_kv_heads: int = 4) -> list[KVLayout]:
    per_rank = max(1, num_kv_heads // tp_size)
    replicas = max(1, tp_size // num_kv_heads)
    return [KVLayout(**{**BASE, "num_kv_heads": num_kv_heads}, tp_size=tp_size, tp_rank=r,
                     kv_head_start=(r // replicas) * per_rank, num_rank_kv_heads=per_rank) for r in range(tp_size)]


def test_a_single_rank_decode_node_reads_each_prefill_ranks_heads_from_it() -> None:
    assert plan_reads(ranks(1), ranks(2), "p") == {0: {0: [0, 1], 1: [2, 3]}}


def test_each_decode_rank_reads_its_heads_from_a_single_rank_prefill_node() -> None:
    assert plan_reads(ranks(2), ranks(1), "p") == {0: {0: [0, 1]}, 1: {0: [2, 3]}}


def test_replicated_kv_heads_are_read_from_the_first_rank_holding_them() -> None:
    # 2 KV heads over 4 prefill ranks: ranks 0, 1 hold head 0 and ranks 2, 3 head 1
    assert plan_reads(ranks(1, num_kv_heads=2), ranks(4, num_kv_heads=2), "p") == {0: {0: [0], 2: [1]}}


def test_a_peer_missing_heads_is_refused_naming_them() -> None:
    missing = r"hold KV heads \[0, 1\] of 4; rank 0 of 1 here needs \[0, 1, 2, 3\]"
    with pytest.raises(IncompatiblePeerError, match=missing):
        plan_reads(ranks(1), ranks(2)[:1], "p")


def test_unit_ids_are_block_times_rank_heads_plus_the_local_head() -> None:
    # prefill rank 1 of 2 holds heads 2, 3 (2 per block); a decode node of one rank holds all 4
    assert unit_ids([5, 6], [2, 3], head_start=2, rank_heads=2).tolist() == [10, 11, 12, 13]
    assert unit_ids([0, 7], [2, 3], head_start=0, rank_heads=4).tolist() == [2, 3, 30, 31]


def test_layouts_of_one_model_pair_whatever_their_split_and_hash_the_split_apart() -> None:
    one, two = ranks(1)[0], ranks(2)[1]
    assert one.pairing_hash == two.pairing_hash and one.layout_hash != two.layout_hash
    assert KVLayout(**{**BASE, "dtype": "bfloat16"}, tp_size=1).pairing_hash != one.pairing_hash


def test_a_rank_set_round_trips_and_one_envelope_stays_itself() -> None:
    assert decode_rank_set(encode_rank_set([b"TKVPa", b"TKVPbb"])) == [b"TKVPa", b"TKVPbb"]
    assert encode_rank_set([b"TKVPa"]) == b"TKVPa" and decode_rank_set(b"TKVPa") == [b"TKVPa"]
