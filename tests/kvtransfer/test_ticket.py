"""KV tickets on the wire and the checksum of KV blocks (kvtransfer.ticket)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from kvtransfer.base import KVRegion
from kvtransfer.errors import InvalidTicketError
from kvtransfer.ticket import CHECKSUM_ALGORITHMS, KVTicket, kv_checksum, verify_kv_checksum

TICKET = KVTicket(ticket_id="t-1", prefill_node_id="prefill-0", incarnation=3, transfer_endpoint=b"TKVP\x00\xff",
                  block_ids=(4, 5, 9), num_tokens=40, layout_hash="ab" * 16, lease_deadline=1_800_000_000.5,
                  checksum="xxh3-128:" + "0" * 32)


def region_of(array: np.ndarray) -> KVRegion:
    return KVRegion.from_buffer(array)


def test_ticket_round_trips_through_json() -> None:
    wire = json.loads(json.dumps(TICKET.to_dict()))
    assert KVTicket.from_dict(wire) == TICKET


def test_ticket_from_dict_ignores_unknown_fields() -> None:
    assert KVTicket.from_dict({**TICKET.to_dict(), "added_later": 1}) == TICKET


@pytest.mark.parametrize(("change", "message"), [
    ({"block_ids": []}, "block_ids"),
    ({"block_ids": [1, 1]}, "distinct"),
    ({"block_ids": [-1]}, "distinct ints >= 0"),
    ({"block_ids": "1,2"}, "list"),
    ({"incarnation": -1}, "incarnation"),
    ({"incarnation": True}, "incarnation"),
    ({"num_tokens": 0}, "num_tokens"),
    ({"lease_deadline": float("nan")}, "lease_deadline"),
    ({"lease_deadline": "soon"}, "lease_deadline"),
    ({"transfer_endpoint": "not base64!"}, "base64"),
    ({"transfer_endpoint": ""}, "transfer_endpoint"),
    ({"checksum": ""}, "checksum"),
    ({"ticket_id": 7}, "ticket_id"),
])
def test_malformed_tickets_raise_invalid_ticket(change: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidTicketError, match=message):
        KVTicket.from_dict({**TICKET.to_dict(), **change})


def test_missing_field_and_non_mapping_raise_invalid_ticket() -> None:
    data = TICKET.to_dict()
    del data["checksum"]
    with pytest.raises(InvalidTicketError, match="checksum"):
        KVTicket.from_dict(data)
    with pytest.raises(InvalidTicketError):
        KVTicket.from_dict([1, 2])  # type: ignore[arg-type]


def test_lease_expiry_and_extension() -> None:
    assert not TICKET.is_expired(now=TICKET.lease_deadline - 1)
    assert TICKET.is_expired(now=TICKET.lease_deadline)
    extended = TICKET.with_lease_deadline(TICKET.lease_deadline + 30)
    assert not extended.is_expired(now=TICKET.lease_deadline)
    assert dataclasses.replace(extended, lease_deadline=TICKET.lease_deadline) == TICKET


@pytest.mark.parametrize("algorithm", CHECKSUM_ALGORITHMS)
def test_checksum_detects_one_flipped_byte_in_any_block(algorithm: str) -> None:
    kv = np.random.default_rng(0).integers(0, 256, size=(16, 1024), dtype=np.uint8)
    region = region_of(kv)
    block_ids = [3, 4, 5, 11]
    checksum = kv_checksum(region, block_ids, algorithm)
    assert checksum.startswith(algorithm + ":")
    assert verify_kv_checksum(checksum, region, block_ids)
    for block, offset in [(3, 0), (4, 517), (11, 1023)]:
        kv[block, offset] ^= 0x01
        assert kv_checksum(region, block_ids, algorithm) != checksum
        assert not verify_kv_checksum(checksum, region, block_ids)
        kv[block, offset] ^= 0x01
    kv[6, 0] ^= 0xFF  # a block outside the ticket does not matter
    assert verify_kv_checksum(checksum, region, block_ids)


def test_checksum_follows_block_order_not_ids() -> None:
    source = np.random.default_rng(1).integers(0, 256, size=(8, 256), dtype=np.uint8)
    destination = np.zeros_like(source)
    destination[[6, 0, 1]] = source[[2, 3, 4]]
    assert kv_checksum(region_of(source), [2, 3, 4]) == kv_checksum(region_of(destination), [6, 0, 1])
    assert kv_checksum(region_of(source), [2, 3, 4]) != kv_checksum(region_of(source), [3, 2, 4])


def test_checksum_rejects_out_of_range_blocks_and_unknown_formats() -> None:
    region = region_of(np.zeros((4, 64), dtype=np.uint8))
    with pytest.raises(InvalidTicketError, match="block ids"):
        kv_checksum(region, [4])
    with pytest.raises(InvalidTicketError, match="unknown checksum"):
        verify_kv_checksum("md5:abcd", region, [0])


def test_per_block_checksums_round_trip_and_must_match_the_blocks() -> None:
    from kvtransfer import InvalidTicketError, KVTicket

    fields = dict(ticket_id="t", prefill_node_id="p", incarnation=1, transfer_endpoint=b"x", block_ids=(4, 2),
                  num_tokens=5, layout_hash="h", lease_deadline=1.0, checksum="xxh3-128:00")
    ticket = KVTicket(**fields, block_checksums=("a:1", "a:2"))
    assert KVTicket.from_dict(ticket.to_dict()) == ticket
    with pytest.raises(InvalidTicketError, match="2 blocks"):
        KVTicket(**fields, block_checksums=("a:1",))
