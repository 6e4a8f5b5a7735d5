"""What a node's engine reports about itself, as wire types: its capacity, its load and its Stats.

Each function runs on the engine thread (through AsyncEngine.call). Torch-free: the engine is only a type here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wire import NodeCapacity, NodeLoad, NodeStats

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


def engine_capacity(engine: LLMEngine) -> NodeCapacity:
    return NodeCapacity(total_kv_blocks=engine.kv.num_blocks, max_num_seqs=engine.config.max_num_seqs,
                        max_num_batched_tokens=engine.config.max_num_batched_tokens,
                        block_size=engine.config.block_size)


def engine_load(engine: LLMEngine) -> NodeLoad:
    scheduler = engine.scheduler
    queued = 0
    for request in (*scheduler.waiting, *scheduler.running):
        pending = request.num_tokens - request.num_computed_tokens
        # one pending token is a decode step; more (or none computed: new or preempted) is prefill work
        if pending > 1 or request.num_computed_tokens == 0:
            queued += pending
    return NodeLoad(free_kv_blocks=engine.kv.num_free_blocks, num_running=len(scheduler.running),
                    num_waiting=len(scheduler.waiting), num_queued_prefill_tokens=queued)


def engine_stats(engine: LLMEngine) -> NodeStats:
    """The Stats every node reports; each role adds its own counters (dataclasses.replace)."""
    return NodeStats(capacity=engine_capacity(engine), load=engine_load(engine),
                     prefix_cache_queries=engine.kv.num_queried_tokens, prefix_cache_hits=engine.kv.num_hit_tokens)
