"""The node's KV pool as kvtransfer regions (one agent per tensor-parallel rank, node_common/sharded_kv.py), its
layout identity, and per-block checksums."""

from __future__ import annotations

from typing import Any

from engine.llm_engine import LLMEngine
from kvtransfer import KVLayout, KVRegion
from kvtransfer.base import Connector
from node_common import sharded_kv
from node_common.sharded_kv import ShardedConnector
from settings.cluster import TransportSettings


def _layout_fields(engine: LLMEngine) -> dict[str, Any]:
    model = engine.model_config
    # The model's identity: its architecture and shape (two copies of one model in different folders pair).
    identity = (f"{model.architecture}:{model.path.name}:{model.hidden_size}x{model.num_layers}"
                f":{model.vocab_size}")
    return {"model": identity, "dtype": engine.kv_cache_dtype,
            "num_layers": model.num_layers, "num_kv_heads": model.num_kv_heads, "head_dim": model.head_dim,
            "block_size": engine.block_size, "hash_seed": engine.config.hash_seed}


def kv_layout(engine: LLMEngine) -> KVLayout:
    """Rank 0's layout. Its `pairing_hash` is the node's layout hash (what the registry and tickets carry): equal
    for nodes of any TP size whose head units mean the same bytes; each rank's envelope carries its split."""
    split = engine.rank_state["runner"].head_split
    return KVLayout(**_layout_fields(engine), tp_size=engine.tensor_parallel_size, tp_rank=0,
                    kv_head_start=split.kv_start, num_rank_kv_heads=split.num_kv_heads)


def node_layout_hash(engine: LLMEngine) -> str:
    return kv_layout(engine).pairing_hash


def open_connector(engine: LLMEngine, backend: str, host: str, name: str,
                   transport: TransportSettings | None = None) -> tuple[Connector, KVRegion, bytes]:
    """Creates every rank's connector with the cluster's transport settings and registers its slice of the KV pool;
    returns (the node's connector, rank 0's pool as a region of whole blocks, the node's metadata: every rank's
    envelope)."""
    transport = transport or TransportSettings()
    connector = ShardedConnector(engine, backend, host, name, dict(transport.connector_options(backend)),
                                 _layout_fields(engine))
    return connector, KVRegion.from_buffer(engine.kv_cache), connector.metadata


def block_checksums(engine: LLMEngine, block_ids: list[int]) -> tuple[str, ...]:
    """One checksum per block, over its head units on every rank (node_common/sharded_kv.py): a decode node that
    already holds some blocks verifies only those it pulled, with the algorithm each checksum names."""
    return sharded_kv.block_checksums(engine, block_ids)


def mismatched_blocks(engine: LLMEngine, block_ids: list[int], expected: tuple[str, ...]) -> list[int]:
    return sharded_kv.mismatched_blocks(engine, block_ids, expected)
