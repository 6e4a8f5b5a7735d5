"""Conversions between the wire (protobuf) and our own types; protobuf stops here and at the service files."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.types import Logprob, PositionLogprobs, SamplingParams
from node_common.registry import engine_load
from protos import tandem_pb2 as pb

if TYPE_CHECKING:  # the proxy imports this module and must not pull in torch
    from engine.llm_engine import LLMEngine


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
    return msg


def params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Raises ValueError (SamplingParams' own validation) on bad values."""
    return SamplingParams(
        temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k, min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None, presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty, repetition_penalty=msg.repetition_penalty,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None, min_tokens=msg.min_tokens,
        stop_token_ids=list(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None)


def logprobs_to_proto(position: PositionLogprobs | None) -> pb.PositionLogprobs | None:
    if position is None:
        return None
    return pb.PositionLogprobs(entries=[pb.TokenLogprob(token_id=t, logprob=lp.logprob, rank=lp.rank)
                                        for t, lp in position.items()])


def logprobs_from_proto(msg: pb.PositionLogprobs) -> PositionLogprobs | None:
    if not msg.entries:
        return None
    return {e.token_id: Logprob(e.logprob, e.rank) for e in msg.entries}


def engine_stats(engine: LLMEngine) -> pb.StatsResponse:
    """The Stats fields every node reports (call on the engine thread); each role adds its own counters."""
    load = engine_load(engine)
    return pb.StatsResponse(
        free_kv_blocks=load.free_kv_blocks, total_kv_blocks=engine.kv.num_blocks,
        num_running=load.num_running, num_waiting=load.num_waiting,
        prefix_cache_queries=engine.kv.num_queried_tokens, prefix_cache_hits=engine.kv.num_hit_tokens,
        max_num_seqs=engine.config.max_num_seqs, max_num_batched_tokens=engine.config.max_num_batched_tokens,
        num_queued_prefill_tokens=load.num_queued_prefill_tokens)
