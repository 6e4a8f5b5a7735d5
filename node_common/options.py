"""Command-line options both node kinds take, and the EngineConfig they make."""

from __future__ import annotations

import argparse
import os
import socket

from engine.config import EngineConfig
from node_common.registry import add_registry_args


def add_node_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (gRPC and KV transfer)")
    parser.add_argument("--port", type=int, required=True, help="gRPC port")
    parser.add_argument("--node-id", default=None, help="defaults to <role>-<hostname>-<port>")
    parser.add_argument("--kv-backend", default="nixl", choices=["nixl", "mooncake"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hash-seed", default="tandem", help="prefix-hash seed; must match cluster-wide")
    parser.add_argument("--log-level", default=os.environ.get("TANDEM_LOG_LEVEL", "INFO"))
    add_registry_args(parser)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    # Nodes see token ids only: the proxy tokenizes and detokenizes.
    return EngineConfig(
        model=args.model, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching, num_kv_blocks=args.num_kv_blocks, seed=args.seed,
        attention_backend=args.attention_backend, hash_seed=args.hash_seed, skip_tokenizer_init=True)


def node_id(args: argparse.Namespace, role: str) -> str:
    return args.node_id or f"{role}-{socket.gethostname()}-{args.port}"
