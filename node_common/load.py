"""What a node's engine reports about itself, as wire types: its capacity, its load and its Stats.

Each function runs on the engine thread (through AsyncEngine.call). Torch-free: the engine is only a type here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wire import NodeCapacity, NodeLoad, NodeStats

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


def engine_capacity(engine: LLMEngine) -> NodeCapacity:
    stats = engine.stats()
    return NodeCapacity(total_kv_blocks=stats.total_kv_blocks, max_num_seqs=stats.max_num_seqs,
                        max_num_batched_tokens=stats.max_num_batched_tokens, block_size=stats.block_size)


def engine_load(engine: LLMEngine) -> NodeLoad:
    stats = engine.stats()
    return NodeLoad(free_kv_blocks=stats.free_kv_blocks, num_running=stats.num_running,
                    num_waiting=stats.num_waiting, num_queued_prefill_tokens=stats.num_queued_prefill_tokens)


def engine_stats(engine: LLMEngine) -> NodeStats:
    """The Stats every node reports; each role adds its own counters (dataclasses.replace)."""
    stats = engine.stats()
    return NodeStats(capacity=engine_capacity(engine), load=engine_load(engine),
                     prefix_cache_queries=stats.prefix_cache_queries, prefix_cache_hits=stats.prefix_cache_hits)
