"""Conversions between protobuf messages and our own types (engine.types, wire): the gRPC edge.

Protobuf stops here and at the service/clients files that call these; everything behind them uses our own
types. Torch-free: the proxy imports it.
"""

from __future__ import annotations

import dataclasses
import math

from engine.types import Logprob, PositionLogprobs, PromptLogprobs, SamplingParams, StructuredOutputsParams
from protos import tandem_pb2 as pb
from wire import InvalidTicketError, KVTicket, NodeCapacity, NodeLoad, NodeStats, TierStats


# ---- sampling parameters ----
def params_to_proto(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, min_tokens=p.min_tokens, stop_token_ids=p.stop_token_ids or [],
        ignore_eos=p.ignore_eos)
    if p.seed is not None:
        msg.seed = p.seed
    if p.max_tokens is not None:
        msg.max_tokens = p.max_tokens
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    if p.structured_outputs is not None:
        msg.structured_outputs.CopyFrom(structured_outputs_to_proto(p.structured_outputs))
    if p.logit_bias:
        msg.logit_bias.update(p.logit_bias)
    return msg


def params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Raises ValueError (SamplingParams' own validation) on bad values."""
    return SamplingParams(
        temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k, min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None, presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty, repetition_penalty=msg.repetition_penalty,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None, min_tokens=msg.min_tokens,
        stop_token_ids=list(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        structured_outputs=(structured_outputs_from_proto(msg.structured_outputs)
                            if msg.HasField("structured_outputs") else None),
        logit_bias=dict(msg.logit_bias) or None)


def structured_outputs_to_proto(s: StructuredOutputsParams) -> pb.StructuredOutputs:
    msg = pb.StructuredOutputs(choice=list(s.choice or ()), json_object=s.json_object,
                               disable_any_whitespace=s.disable_any_whitespace,
                               disable_additional_properties=s.disable_additional_properties)
    for name, value in (("json", s.json_text), ("regex", s.regex), ("grammar", s.grammar),
                        ("structural_tag", s.structural_tag)):
        if value is not None:
            setattr(msg, name, value)
    return msg


def structured_outputs_from_proto(msg: pb.StructuredOutputs) -> StructuredOutputsParams:
    """Raises ValueError (StructuredOutputsParams' own checks) unless exactly one constraint is set."""
    return StructuredOutputsParams(
        json=msg.json if msg.HasField("json") else None, regex=msg.regex if msg.HasField("regex") else None,
        choice=list(msg.choice) or None, grammar=msg.grammar if msg.HasField("grammar") else None,
        json_object=msg.json_object, disable_any_whitespace=msg.disable_any_whitespace,
        disable_additional_properties=msg.disable_additional_properties,
        structural_tag=msg.structural_tag if msg.HasField("structural_tag") else None)


# ---- a request's deadline ----
def deadline_from_proto(deadline: float) -> float | None:
    """A request's deadline (unix time), None for 0 (none). Raises ValueError for NaN and infinities: a deadline
    no clock reaches, or one no comparison can tell."""
    if not math.isfinite(deadline):
        raise ValueError(f"deadline must be a finite unix time (0: none), got {deadline}")
    return deadline or None


# ---- logprobs ----
def logprobs_to_proto(position: PositionLogprobs | None) -> pb.PositionLogprobs | None:
    if position is None:
        return None
    return pb.PositionLogprobs(entries=[pb.TokenLogprob(token_id=t, logprob=lp.logprob, rank=lp.rank)
                                        for t, lp in position.items()])


def logprobs_from_proto(msg: pb.PositionLogprobs) -> PositionLogprobs | None:
    if not msg.entries:
        return None
    return {e.token_id: Logprob(e.logprob, e.rank) for e in msg.entries}


def prompt_logprobs_to_proto(prompt_logprobs: PromptLogprobs) -> pb.PromptLogprobs:
    """Positions 1, 2, ... (position 0 has none)."""
    assert prompt_logprobs and prompt_logprobs[0] is None, "a prompt's logprobs start with position 0's None"
    msg = pb.PromptLogprobs()
    for position in prompt_logprobs[1:]:
        assert position is not None, "every prompt position after the first has logprobs"
        msg.positions.add().entries.extend(pb.TokenLogprob(token_id=t, logprob=lp.logprob, rank=lp.rank)
                                           for t, lp in position.items())
    return msg


def prompt_logprobs_from_proto(msg: pb.PromptLogprobs) -> PromptLogprobs:
    """vLLM's shape: None for position 0, then a dict per position."""
    return [None, *({e.token_id: Logprob(e.logprob, e.rank) for e in position.entries}
                    for position in msg.positions)]


# ---- the KV ticket ----
def ticket_to_proto(ticket: KVTicket) -> pb.KVTicket:
    return pb.KVTicket(
        ticket_id=ticket.ticket_id, prefill_node_id=ticket.prefill_node_id, prefill_address=ticket.prefill_address,
        incarnation=ticket.incarnation, transfer_metadata=ticket.transfer_endpoint, block_ids=list(ticket.block_ids),
        num_tokens=ticket.num_tokens, layout_hash=ticket.layout_hash, lease_deadline=ticket.lease_deadline,
        block_checksums=list(ticket.block_checksums))


def ticket_from_proto(msg: pb.KVTicket) -> KVTicket:
    """Raises InvalidTicketError for a malformed ticket (a missing field reads as its empty default)."""
    if not isinstance(msg, pb.KVTicket):
        raise InvalidTicketError(f"a ticket is a KVTicket message, got {type(msg).__name__}")
    return KVTicket(ticket_id=msg.ticket_id, prefill_node_id=msg.prefill_node_id,
                    prefill_address=msg.prefill_address, incarnation=msg.incarnation,
                    transfer_endpoint=msg.transfer_metadata, block_ids=tuple(msg.block_ids),
                    num_tokens=msg.num_tokens, layout_hash=msg.layout_hash, lease_deadline=msg.lease_deadline,
                    block_checksums=tuple(msg.block_checksums))


# ---- a node's stats ----
def stats_to_proto(stats: NodeStats) -> pb.StatsResponse:
    capacity, load = stats.capacity, stats.load
    return pb.StatsResponse(
        free_kv_blocks=load.free_kv_blocks, total_kv_blocks=capacity.total_kv_blocks, num_running=load.num_running,
        num_waiting=load.num_waiting, num_queued_prefill_tokens=load.num_queued_prefill_tokens,
        max_num_seqs=capacity.max_num_seqs, max_num_batched_tokens=capacity.max_num_batched_tokens,
        prefix_cache_queries=stats.prefix_cache_queries, prefix_cache_hits=stats.prefix_cache_hits,
        num_pinned_tickets=stats.num_pinned_tickets, num_leases_expired=stats.num_leases_expired,
        num_transfer_failures=stats.num_transfer_failures, kv_transfer_bytes=stats.kv_transfer_bytes,
        kv_transfer_count=stats.kv_transfer_count, kv_transfer_seconds_sum=stats.kv_transfer_seconds_sum,
        spec_decode_num_drafts=stats.spec_decode_num_drafts,
        spec_decode_num_draft_tokens=stats.spec_decode_num_draft_tokens,
        spec_decode_num_accepted_tokens=stats.spec_decode_num_accepted_tokens,
        host_tier=_tier_to_proto(stats.host_tier), store_tier=_tier_to_proto(stats.store_tier))


def _tier_to_proto(tier: TierStats | None) -> pb.TierStats | None:
    return None if tier is None else pb.TierStats(**dataclasses.asdict(tier))


def _tier_from_proto(msg: pb.StatsResponse, name: str) -> TierStats | None:
    if not msg.HasField(name):
        return None
    tier = getattr(msg, name)
    return TierStats(**{f.name: getattr(tier, f.name) for f in dataclasses.fields(TierStats)})


def stats_from_proto(msg: pb.StatsResponse) -> NodeStats:
    """The capacity's block_size is 0: Stats does not report it."""
    return NodeStats(
        capacity=NodeCapacity(total_kv_blocks=msg.total_kv_blocks, max_num_seqs=msg.max_num_seqs,
                              max_num_batched_tokens=msg.max_num_batched_tokens, block_size=0),
        load=NodeLoad(free_kv_blocks=msg.free_kv_blocks, num_running=msg.num_running, num_waiting=msg.num_waiting,
                      num_queued_prefill_tokens=msg.num_queued_prefill_tokens),
        prefix_cache_queries=msg.prefix_cache_queries, prefix_cache_hits=msg.prefix_cache_hits,
        num_pinned_tickets=msg.num_pinned_tickets, num_leases_expired=msg.num_leases_expired,
        num_transfer_failures=msg.num_transfer_failures, kv_transfer_bytes=msg.kv_transfer_bytes,
        kv_transfer_count=msg.kv_transfer_count, kv_transfer_seconds_sum=msg.kv_transfer_seconds_sum,
        spec_decode_num_drafts=msg.spec_decode_num_drafts,
        spec_decode_num_draft_tokens=msg.spec_decode_num_draft_tokens,
        spec_decode_num_accepted_tokens=msg.spec_decode_num_accepted_tokens,
        host_tier=_tier_from_proto(msg, "host_tier"), store_tier=_tier_from_proto(msg, "store_tier"))
