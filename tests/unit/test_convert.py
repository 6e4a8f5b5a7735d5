"""The gRPC edge's conversions (protos/convert.py): our own types survive protobuf, and a malformed ticket from
the wire is refused by name. The examples come first, then the same as properties over any value (hypothesis)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Callable

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.types import Logprob, SamplingParams, StructuredOutputsParams
from protos import tandem_pb2 as pb
from protos.convert import (
    deadline_from_proto,
    logprobs_from_proto,
    logprobs_to_proto,
    params_from_proto,
    params_to_proto,
    prompt_logprobs_from_proto,
    prompt_logprobs_to_proto,
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


# ---- properties (hypothesis): every wire value converts back to itself, and any message at all is either a value
# of ours or the error its reader names ----

INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
NAME = st.text(st.characters(codec="utf-8"), min_size=1, max_size=20)  # proto strings: UTF-8
FINITE = st.floats(allow_nan=False, allow_infinity=False)
WIRE = settings(max_examples=150, deadline=None)


@st.composite
def tickets(draw: st.DrawFn) -> KVTicket:
    num_blocks = draw(st.integers(1, 8))
    return KVTicket(ticket_id=draw(NAME), prefill_node_id=draw(NAME), prefill_address=draw(NAME),
                    incarnation=draw(st.integers(0, 2**63 - 1)), transfer_endpoint=draw(st.binary(min_size=1)),
                    block_ids=tuple(draw(st.lists(st.integers(0, 2**31 - 1), min_size=num_blocks, max_size=num_blocks,
                                                  unique=True))),
                    num_tokens=draw(st.integers(1, 2**31 - 1)), layout_hash=draw(NAME), lease_deadline=draw(FINITE),
                    block_checksums=tuple(draw(st.lists(NAME, min_size=num_blocks, max_size=num_blocks))))


def any_ticket_message() -> st.SearchStrategy[pb.KVTicket]:
    return st.builds(pb.KVTicket, ticket_id=st.text(st.characters(codec="utf-8"), max_size=8),
                     prefill_node_id=st.sampled_from(["", "p"]), incarnation=INT64,
                     transfer_metadata=st.binary(max_size=8), block_ids=st.lists(INT32, max_size=4),
                     num_tokens=INT32, layout_hash=st.sampled_from(["", "h"]),
                     lease_deadline=st.floats(allow_nan=True, allow_infinity=True),
                     block_checksums=st.lists(st.sampled_from(["", "xxh3-128:0a"]), max_size=4),
                     prefill_address=st.sampled_from(["", "p:1"]))


@WIRE
@given(ticket=tickets())
def test_any_ticket_survives_protobuf(ticket: KVTicket) -> None:
    assert ticket_from_proto(over_the_wire(ticket_to_proto(ticket))) == ticket


@WIRE
@given(message=any_ticket_message())
def test_any_ticket_message_is_a_ticket_or_an_invalid_ticket_error(message: pb.KVTicket) -> None:
    try:
        ticket = ticket_from_proto(over_the_wire(message))
    except InvalidTicketError:
        return
    assert ticket_to_proto(ticket) == message  # what it accepts, it carries whole


@WIRE
@given(raw=st.binary(max_size=64))
def test_any_bytes_are_a_ticket_message_a_decode_error_or_an_invalid_ticket(raw: bytes) -> None:
    try:
        message = pb.KVTicket.FromString(raw)
    except DecodeError:
        return
    with contextlib.suppress(InvalidTicketError):
        ticket_from_proto(message)


@st.composite
def sampling_params(draw: st.DrawFn) -> SamplingParams:
    max_tokens = draw(st.one_of(st.none(), st.integers(1, 2**31 - 1)))
    return SamplingParams(
        temperature=draw(st.floats(0, 1e6)), top_p=draw(st.floats(0, 1, exclude_min=True)),
        top_k=draw(st.integers(0, 2**31 - 1)), min_p=draw(st.floats(0, 1)), seed=draw(st.one_of(st.none(), INT64)),
        presence_penalty=draw(st.floats(-2, 2)), frequency_penalty=draw(st.floats(-2, 2)),
        repetition_penalty=draw(st.floats(0, 1e6, exclude_min=True)), max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens or 2**31 - 1)),
        stop_token_ids=draw(st.lists(st.integers(0, 2**31 - 1), max_size=4)), ignore_eos=draw(st.booleans()),
        logprobs=draw(st.one_of(st.none(), st.integers(0, 2**31 - 1))),
        prompt_logprobs=draw(st.one_of(st.none(), st.integers(0, 2**31 - 1))))


@WIRE
@given(params=sampling_params())
def test_any_sampling_params_survive_protobuf(params: SamplingParams) -> None:
    message = pb.SamplingParams.FromString(params_to_proto(params).SerializeToString())
    assert params_from_proto(message) == params


@WIRE
@given(message=st.builds(
    pb.SamplingParams, temperature=st.floats(), top_p=st.floats(), top_k=INT32, min_p=st.floats(),
    seed=st.one_of(st.none(), INT64), presence_penalty=st.floats(), frequency_penalty=st.floats(),
    repetition_penalty=st.floats(), max_tokens=st.one_of(st.none(), INT32), min_tokens=INT32,
    stop_token_ids=st.lists(INT32, max_size=3), ignore_eos=st.booleans(), logprobs=st.one_of(st.none(), INT32),
    prompt_logprobs=st.one_of(st.none(), INT32)))
def test_any_sampling_params_message_is_valid_params_or_a_value_error(message: pb.SamplingParams) -> None:
    try:
        params = params_from_proto(message)
    except ValueError:
        return
    # what it accepts, the engine can sample with: finite numbers in their ranges
    assert params.temperature >= 0 and 0 < params.top_p <= 1 and 0 <= params.min_p <= 1
    assert -2 <= params.presence_penalty <= 2 and -2 <= params.frequency_penalty <= 2
    assert 0 < params.repetition_penalty < math.inf and params.temperature < math.inf
    assert params.top_k >= 0 and params.min_tokens >= 0 and (params.max_tokens or 1) >= 1
    assert all(t >= 0 for t in params.stop_token_ids or []) and (params.logprobs or 0) >= 0
    assert (params.prompt_logprobs or 0) >= 0


def test_non_finite_sampling_numbers_and_deadlines_are_refused() -> None:
    """NaN passes every range check, and an infinite temperature or penalty makes NaN logits: both refused by name
    (found by tests/integration/test_fuzz_nodes.py: NaN temperature was served)."""
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        for value in (math.nan, math.inf):
            message = params_to_proto(SamplingParams())
            setattr(message, name, value)
            with pytest.raises(ValueError, match=name):
                params_from_proto(message)
    assert deadline_from_proto(0.0) is None and deadline_from_proto(1.5e9) == 1.5e9
    for deadline in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="deadline"):
            deadline_from_proto(deadline)


@WIRE
@given(position=st.dictionaries(st.integers(0, 2**31 - 1), st.builds(Logprob, FINITE, st.integers(1, 2**31 - 1)),
                                min_size=1, max_size=5))
def test_any_logprobs_survive_protobuf(position: dict[int, Logprob]) -> None:
    encoded = logprobs_to_proto(position)
    assert encoded is not None
    assert logprobs_from_proto(pb.PositionLogprobs.FromString(encoded.SerializeToString())) == position


@WIRE
@given(positions=st.lists(st.dictionaries(st.integers(0, 2**31 - 1),
                                          st.builds(Logprob, FINITE, st.integers(1, 2**31 - 1)), min_size=1,
                                          max_size=3), max_size=4))
def test_any_prompt_logprobs_survive_protobuf(positions: list[dict[int, Logprob]]) -> None:
    prompt_logprobs = [None, *positions]  # position 0 has none
    encoded = prompt_logprobs_to_proto(prompt_logprobs).SerializeToString()
    assert prompt_logprobs_from_proto(pb.PromptLogprobs.FromString(encoded)) == prompt_logprobs


STRUCTURAL_TAG = json.dumps({"type": "structural_tag", "triggers": ["<tool_call>"], "structures": [
    {"begin": "<tool_call>{\"name\": \"f\", \"arguments\": ", "schema": {"type": "object"}, "end": "}</tool_call>"}]})


def test_logit_bias_and_a_structural_tag_survive_protobuf() -> None:
    params = SamplingParams(temperature=0.0, logit_bias={0: -100, 7: 2.5, 2**31 - 1: 100},
                            structured_outputs=StructuredOutputsParams(structural_tag=STRUCTURAL_TAG,
                                                                       disable_any_whitespace=True))
    message = pb.SamplingParams.FromString(params_to_proto(params).SerializeToString())
    assert dict(message.logit_bias) == {0: -100.0, 7: 2.5, 2**31 - 1: 100.0}
    assert message.structured_outputs.structural_tag == STRUCTURAL_TAG
    assert params_from_proto(message) == params
    assert params_from_proto(params_to_proto(SamplingParams())).logit_bias is None  # an empty map: none


@pytest.mark.parametrize("logit_bias, match", [({-1: 1.0}, "logit_bias token ids"),
                                               ({3: 100.5}, "logit_bias of token 3"),
                                               ({3: math.nan}, "logit_bias of token 3")])
def test_a_bad_logit_bias_from_the_wire_is_a_value_error(logit_bias: dict[int, float], match: str) -> None:
    message = params_to_proto(SamplingParams())
    message.logit_bias.update(logit_bias)
    with pytest.raises(ValueError, match=match):
        params_from_proto(message)


@WIRE
@given(logit_bias=st.dictionaries(st.integers(0, 2**31 - 1), st.floats(-100, 100), max_size=5))
def test_any_logit_bias_survives_protobuf(logit_bias: dict[int, float]) -> None:
    params = SamplingParams(logit_bias=logit_bias)
    assert params_from_proto(pb.SamplingParams.FromString(params_to_proto(params).SerializeToString())) == params


COUNT32, COUNT64 = st.integers(0, 2**31 - 1), st.integers(0, 2**63 - 1)


@WIRE
@given(stats=st.builds(
    NodeStats, capacity=st.builds(NodeCapacity, COUNT32, COUNT32, COUNT32, st.just(0)),
    load=st.builds(NodeLoad, COUNT32, COUNT32, COUNT32, COUNT64), prefix_cache_queries=COUNT64,
    prefix_cache_hits=COUNT64, num_pinned_tickets=COUNT32, num_leases_expired=COUNT64, num_transfer_failures=COUNT64,
    kv_transfer_bytes=COUNT64, kv_transfer_count=COUNT64, kv_transfer_seconds_sum=FINITE))
def test_any_stats_survive_protobuf(stats: NodeStats) -> None:
    assert stats_from_proto(pb.StatsResponse.FromString(stats_to_proto(stats).SerializeToString())) == stats
