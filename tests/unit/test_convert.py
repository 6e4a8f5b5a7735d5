"""The gRPC edge's conversions (protos/convert.py): our own types survive protobuf, and a malformed ticket from
the wire is refused by name."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest

from engine.types import Logprob, SamplingParams
from protos import tandem_pb2 as pb
from protos.convert import (
    logprobs_from_proto,
    logprobs_to_proto,
    params_from_proto,
    params_to_proto,
    stats_from_proto,
    stats_to_proto,
    ticket_from_proto,
    ticket_to_proto,
)
from wire import InvalidTicketError, KVTicket, NodeCapacity, NodeLoad, NodeStats

TICKET = KVTicket(ticket_id="t-1", prefill_node_id="prefill-0", prefill_address="prefill-0.svc:50051", incarnation=3,
                  transfer_endpoint=b"TKVP\x00\xff", block_ids=(4, 5, 9), num_tokens=10, layout_hash="ab" * 16,
                  lease_deadline=1_800_000_000.5, block_checksums=("xxh3-128:01", "xxh3-128:02", "xxh3-128:03"))


def over_the_wire(message: pb.KVTicket) -> pb.KVTicket:
    return pb.KVTicket.FromString(message.SerializeToString())


def test_a_ticket_survives_protobuf() -> None:
    message = over_the_wire(ticket_to_proto(TICKET))
    assert message.prefill_address == "prefill-0.svc:50051" and list(message.block_ids) == [4, 5, 9]
    assert ticket_from_proto(message) == TICKET


def test_the_ticket_has_one_checksum_scheme_per_block() -> None:
    assert "checksum" not in pb.KVTicket.DESCRIPTOR.fields_by_name
    assert not hasattr(TICKET, "checksum")


def _missing(name: str) -> Callable[[pb.KVTicket], None]:
    return lambda message: message.ClearField(name)


def _set(name: str, value: object) -> Callable[[pb.KVTicket], None]:
    return lambda message: setattr(message, name, value)


@pytest.mark.parametrize("damage, field", [
    (_missing("ticket_id"), "ticket_id"),
    (_missing("prefill_address"), "prefill_address"),
    (_missing("prefill_node_id"), "prefill_node_id"),
    (_missing("transfer_metadata"), "transfer_endpoint"),
    (_missing("layout_hash"), "layout_hash"),
    (_missing("block_ids"), "block_ids"),
    (_set("num_tokens", 0), "num_tokens"),
    (_set("incarnation", -1), "incarnation"),
    (_set("lease_deadline", math.nan), "lease_deadline"),
    (lambda message: message.block_ids.append(4), "block_ids"),  # a block twice (and checksums short)
    (lambda message: message.block_checksums.pop(), "block checksums"),
    (lambda message: message.block_checksums.__setitem__(0, ""), "block_checksums"),
])
def test_a_malformed_ticket_is_an_invalid_ticket_error_naming_the_field(
        damage: Callable[[pb.KVTicket], None], field: str) -> None:
    message = over_the_wire(ticket_to_proto(TICKET))
    damage(message)
    with pytest.raises(InvalidTicketError, match=field):
        ticket_from_proto(message)
    assert issubclass(InvalidTicketError, ValueError)  # what the services map to INVALID_ARGUMENT


def test_sampling_params_and_logprobs_survive_protobuf() -> None:
    params = SamplingParams(temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=7, max_tokens=12, min_tokens=2,
                            stop_token_ids=[3, 4], ignore_eos=True, logprobs=2, repetition_penalty=1.1)
    message = pb.SamplingParams.FromString(params_to_proto(params).SerializeToString())
    assert params_from_proto(message) == params
    unset = params_from_proto(params_to_proto(SamplingParams()))
    assert (unset.seed, unset.max_tokens, unset.logprobs) == (None, SamplingParams().max_tokens, None)
    position = {7: Logprob(-0.25, 1), 9: Logprob(-2.5, 2)}
    encoded = logprobs_to_proto(position)
    assert encoded is not None and logprobs_from_proto(encoded) == position
    assert logprobs_to_proto(None) is None and logprobs_from_proto(pb.PositionLogprobs()) is None


def test_stats_survive_protobuf_except_the_block_size_stats_does_not_carry() -> None:
    stats = NodeStats(NodeCapacity(64, 8, 2048, 16), NodeLoad(60, 1, 2, 30), prefix_cache_queries=100,
                      prefix_cache_hits=40, num_pinned_tickets=1, num_leases_expired=2, num_transfer_failures=3,
                      kv_transfer_bytes=4096, kv_transfer_count=5, kv_transfer_seconds_sum=0.25)
    message = pb.StatsResponse.FromString(stats_to_proto(stats).SerializeToString())
    assert message.free_kv_blocks == 60 and message.total_kv_blocks == 64 and message.num_queued_prefill_tokens == 30
    assert stats_from_proto(message) == dataclasses.replace(stats, capacity=NodeCapacity(64, 8, 2048, 0))
