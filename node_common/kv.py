"""The node's KV pool as a kvtransfer region, its layout identity, and per-block checksums."""

from __future__ import annotations

from engine.llm_engine import LLMEngine
from kvtransfer import KVLayout, KVRegion, make_connector
from kvtransfer.base import Connector
from kvtransfer.checksum import kv_block_checksums
from settings.cluster import TransportSettings


def kv_layout(engine: LLMEngine) -> KVLayout:
    model = engine.model_config
    # The model's identity: its architecture and shape (two copies of one model in different folders pair).
    identity = (f"{model.architecture}:{model.path.name}:{model.hidden_size}x{model.num_layers}"
                f":{model.vocab_size}")
    return KVLayout(model=identity, dtype=engine.kv_cache_dtype,
                    num_layers=model.num_layers, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
                    block_size=engine.block_size, tp_size=1, hash_seed=engine.config.hash_seed)


def kv_region(engine: LLMEngine) -> KVRegion:
    return KVRegion.from_buffer(engine.kv_cache)


def open_connector(engine: LLMEngine, backend: str, host: str, name: str,
                   transport: TransportSettings | None = None) -> tuple[Connector, KVRegion, bytes]:
    """Creates the node's connector with the cluster's transport settings and registers its KV pool; returns
    (connector, region, metadata)."""
    transport = transport or TransportSettings()
    connector = make_connector(backend, layout=kv_layout(engine), agent_name=name, host=host,
                               **transport.connector_options(backend))
    region = kv_region(engine)
    # a GPU pool's checksums run a Triton kernel: compile it now, not on the first request's ticket
    block_checksums(region, [0])
    return connector, region, connector.register(region)


def block_checksums(region: KVRegion, block_ids: list[int]) -> tuple[str, ...]:
    """One checksum per block, all computed in one batch (for a GPU pool: one kernel launch and one small copy
    to the host, kvtransfer/gpu_checksum.py): a decode node that already holds some blocks verifies only those
    it pulled, with the algorithm each checksum names (kvtransfer.checksum.mismatched_blocks)."""
    return tuple(kv_block_checksums(region, block_ids))
