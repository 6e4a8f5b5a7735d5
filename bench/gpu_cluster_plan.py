"""What bench/gpu_cluster.py will run, fixed before any process starts: the preflight in a child, the GPU
memory split between the nodes (as --num-kv-blocks), the bench points, and the nodes' flags."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.cluster_procs import ROOT, child_env
from bench.gpu_cluster_checks import BenchPoint
from bench.shape_model import LLAMA8B_SHAPE_DIR, num_parameters, write_tiny

GIB = 1 << 30


@dataclass(frozen=True)
class Plan:
    """Everything the run does, fixed before any process starts (and recorded in results.json)."""

    model: str
    served_name: str
    device: str
    dtype: str
    kv_backend: str
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    prefill_kv_blocks: int
    decode_kv_blocks: int
    colocated_kv_blocks: int
    points: tuple[BenchPoint, ...]
    latency_prompt_lens: tuple[int, ...]
    latency_runs: int
    correctness_tokens: int
    hf_batch_sizes: str
    hf_input_len: int
    hf_output_len: int
    node_env: tuple[tuple[str, str], ...]
    node_args: tuple[str, ...]
    # 1: both nodes share the one GPU (colocated: one decode node). 2: P/D puts P on GPU 0 and D on GPU 1; colocated
    # runs a decode node on each GPU behind the proxy (the same two GPUs, no handoff)
    num_gpus: int = 1
    goodput: tuple[str, ...] = ()  # SLOs of the serving points, as `tandem bench serve --goodput` takes them


# Run in a child: imports what the nodes, the proxy and the client import (a missing wheel or a gRPC/protobuf older
# than the generated stubs fails here, in seconds, with the import's own message), and reads the GPU.
_PREFLIGHT = """
import json, platform, sys
import torch, transformers, triton, grpc, google.protobuf
import protos.tandem_pb2_grpc, proxy.api.app, benchmark.cli, node_common.server, prefill_node.service
from settings.cluster import KV_BACKENDS
if sys.argv[1] not in KV_BACKENDS:
    sys.exit(f"--kv-backend {sys.argv[1]}: the nodes of this tree know {', '.join(KV_BACKENDS)}")
if sys.argv[1] == "nixl":
    import nixl._api
elif sys.argv[1] == "mooncake":
    import mooncake.engine
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": triton.__version__, "transformers": transformers.__version__, "grpc": grpc.__version__,
        "protobuf": google.protobuf.__version__}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, gpu_total_bytes=p.total_memory)
print(json.dumps(info))
"""


def device_info(device: str, kv_backend: str) -> dict[str, Any]:
    """Library versions and the GPU, from a child process (a CUDA context here would hold GPU memory)."""
    env = child_env({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {})
    out = subprocess.run([sys.executable, "-c", _PREFLIGHT, kv_backend], capture_output=True, text=True,
                         timeout=300, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"preflight failed (a wheel missing from PYTHONPATH? a backend the nodes lack?):\n"
                         f"{out.stderr.strip()[-1500:]}")
    info: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    if device == "cuda" and "gpu" not in info:
        raise SystemExit("--device cuda, but torch sees no GPU (--device cpu for a CPU run)")
    return info


def kv_block_bytes(model: Path, block_size: int, dtype_bytes: int) -> int:
    """One KV block of every layer (K and V), as the engine lays it out."""
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * block_size * config["num_key_value_heads"] * head_dim * dtype_bytes


def split_kv_blocks(usable_bytes: float, per_node_bytes: float, block_bytes: int, prefill_share: float
                    ) -> tuple[int, int, int]:
    """(P's, D's in P/D, D's alone) KV blocks: what is left of `usable_bytes` after each node's weights and
    reserve (`per_node_bytes`); P takes `prefill_share` of the P/D remainder."""
    pd_kv, alone_kv = usable_bytes - 2 * per_node_bytes, usable_bytes - per_node_bytes
    if pd_kv < block_bytes or not 0 < prefill_share < 1:
        raise SystemExit(f"two nodes of {per_node_bytes / GIB:.1f} GiB each leave no KV memory in "
                         f"{usable_bytes / GIB:.1f} GiB (or --prefill-kv-share {prefill_share} is not in (0, 1))")
    prefill = max(1, int(pd_kv * prefill_share // block_bytes))
    return prefill, int(pd_kv // block_bytes) - prefill, int(alone_kv // block_bytes)


def kv_blocks(args: argparse.Namespace, model: Path, dtype_bytes: int, gpu_total_bytes: int | None
              ) -> tuple[int, int, int]:
    """(P's, D's in P/D, each decode node's when colocated) KV blocks."""
    if args.device == "cpu":  # small pools: the CPU smoke run
        return (1024, 1024, 1024) if args.gpus == 2 else (512, 1024, 1536)
    total = args.gpu_memory_gib * GIB if args.gpu_memory_gib else gpu_total_bytes
    assert total, "a GPU run knows the GPU's memory"
    # The weights and a reserve per node (activations, CUDA graphs, the transfer library's buffers). The engine
    # builds the model in its dtype and empties torch's cache after loading (engine/model/loader.py); it used to
    # build in float32 and cast, leaving a float32 copy cached that this plan had to count twice over.
    weights = num_parameters(model) * dtype_bytes
    per_node = weights + args.node_reserve_gib * GIB
    if args.gpus == 2:  # a GPU per node in both modes: each node's pool is what its GPU has left
        block_bytes = kv_block_bytes(model, args.block_size, dtype_bytes)
        per_gpu = int((total * args.memory_fraction - per_node) // block_bytes)
        if per_gpu < 1:
            raise SystemExit(f"a node of {per_node / GIB:.1f} GiB leaves no KV memory on a GPU of "
                             f"{total / GIB:.1f} GiB")
        return per_gpu, per_gpu, per_gpu
    return split_kv_blocks(total * args.memory_fraction, per_node, kv_block_bytes(model, args.block_size, dtype_bytes),
                           args.prefill_kv_share)


def make_plan(args: argparse.Namespace, gpu_total_bytes: int | None) -> Plan:
    model = args.model or (write_tiny(args.out / "tiny-model") if args.tiny else LLAMA8B_SHAPE_DIR)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    short, long = ((64, 16), (512, 8)) if args.tiny else ((1024, 256), (8192, 128))
    points: list[BenchPoint] = []
    short_concurrency = args.short_concurrency or ("1,4" if args.tiny else "1,16,64")
    long_concurrency = args.long_concurrency or ("1,2" if args.tiny else "1,16")
    for (input_len, output_len), concurrencies in ((short, short_concurrency), (long, long_concurrency)):
        for c in (int(c) for c in concurrencies.split(",") if c.strip()):
            points.append(BenchPoint(f"{input_len}/{output_len}", input_len, output_len, c,
                                     max(4, args.prompts_per_concurrency * c), seed=100 + len(points)))
    prefill_blocks, decode_blocks, alone_blocks = kv_blocks(args, model, 4 if dtype == "float32" else 2,
                                                          gpu_total_bytes)
    env = {"NIXL_LOG_LEVEL": "WARN"}
    if args.device == "cpu":  # UCX on a CPU box: docs/environment.md#ucx-and-nixl
        env.update({"CUDA_VISIBLE_DEVICES": "", "UCX_MODULES": "^ib"})
    else:
        env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = "y"
    env.update(kv.split("=", 1) for kv in args.node_env)
    node_args = shlex.split(args.node_args)
    if args.kv_backend == "auto":
        node_args += ["--kv-cross-host-backend", getattr(args, "kv_cross_host_backend", "nixl")]
    if args.device == "cpu" and args.kv_backend == "nixl":
        node_args += ["--ucx-devices", "lo"]
    return Plan(model=str(model.resolve()), served_name=model.name, device=args.device, dtype=dtype,
                kv_backend=args.kv_backend, block_size=args.block_size, max_model_len=16384 if not args.tiny else 2048,
                max_num_batched_tokens=args.max_num_batched_tokens or (2048 if args.tiny else 8192),
                max_num_seqs=args.max_num_seqs, prefill_kv_blocks=prefill_blocks, decode_kv_blocks=decode_blocks,
                colocated_kv_blocks=alone_blocks, points=tuple(points),
                latency_prompt_lens=(64, 512) if args.tiny else (1024, 8192), latency_runs=args.latency_runs,
                correctness_tokens=32, hf_batch_sizes="1,4" if args.tiny else "1,16",
                hf_input_len=short[0], hf_output_len=short[1], node_env=tuple(sorted(env.items())),
                node_args=tuple(node_args), num_gpus=args.gpus, goodput=tuple(args.goodput))


def node_flags(plan: Plan, num_kv_blocks: int, seed: int, enforce_eager: bool, gpu: int | None = None) -> list[str]:
    """A node's flags; `gpu`: its GPU's index on a machine of several (all GPUs stay visible to every node, so
    CUDA IPC handles name the same devices in each)."""
    device = [] if gpu is None or plan.device != "cuda" else ["--device", f"cuda:{gpu}"]
    flags = device + ["--dtype", plan.dtype, "--kv-backend", plan.kv_backend, "--load-format", "dummy",
                      "--seed", str(seed), "--block-size", str(plan.block_size), "--num-kv-blocks", str(num_kv_blocks),
                      "--max-model-len", str(plan.max_model_len), "--max-num-seqs", str(plan.max_num_seqs),
                      "--max-num-batched-tokens", str(plan.max_num_batched_tokens), "--log-level", "WARNING",
                      "--drain-timeout", "10"]
    return flags + (["--enforce-eager"] if enforce_eager else []) + list(plan.node_args)
