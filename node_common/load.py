"""What a node's engine reports about itself, as wire types: its capacity, its load and its Stats.

Each function runs on the engine thread (through AsyncEngine.call). Torch-free: the engine is only a type here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wire import NodeCapacity, NodeLoad, NodeStats, TierStats

if TYPE_CHECKING:
    from engine.kv_tiers import HostTierStats
    from engine.llm_engine import EngineStats, LLMEngine
    from node_common.store_tier import StoreTier


def engine_capacity(engine: LLMEngine) -> NodeCapacity:
    return _capacity(engine.stats())


def engine_load(engine: LLMEngine) -> NodeLoad:
    return _load(engine.stats())


def engine_stats(engine: LLMEngine, store: StoreTier | None = None) -> NodeStats:
    """The Stats every node reports; each role adds its own counters (dataclasses.replace)."""
    stats = engine.stats()  # once: it walks the waiting and running requests
    return NodeStats(capacity=_capacity(stats), load=_load(stats), prefix_cache_queries=stats.prefix_cache_queries,
                     prefix_cache_hits=stats.prefix_cache_hits, spec_decode_num_drafts=stats.spec_decode_num_drafts,
                     spec_decode_num_draft_tokens=stats.spec_decode_num_draft_tokens,
                     spec_decode_num_accepted_tokens=stats.spec_decode_num_accepted_tokens,
                     host_tier=None if stats.host_tier is None else _host_tier(stats.host_tier),
                     store_tier=None if store is None else store.tier_stats())


def _host_tier(host: HostTierStats) -> TierStats:
    return TierStats(queries=host.query_tokens, hits=host.hit_tokens, read_bytes=host.num_loaded * host.slot_bytes,
                     write_bytes=(host.num_spilled + host.num_imported) * host.slot_bytes, used_blocks=host.num_used,
                     total_blocks=host.num_slots)


def _capacity(stats: EngineStats) -> NodeCapacity:
    return NodeCapacity(total_kv_blocks=stats.total_kv_blocks, max_num_seqs=stats.max_num_seqs,
                        max_num_batched_tokens=stats.max_num_batched_tokens, block_size=stats.block_size)


def _load(stats: EngineStats) -> NodeLoad:
    return NodeLoad(free_kv_blocks=stats.free_kv_blocks, num_running=stats.num_running,
                    num_waiting=stats.num_waiting, num_queued_prefill_tokens=stats.num_queued_prefill_tokens)
