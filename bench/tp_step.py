"""What bench/decode_step.py needs for several ranks and other model shapes: the shapes' configs, and the time a
decode step's collectives take, replayed on every rank of a running engine (an engine CALL, so the same process
group and the same GPUs as the step itself).

A tensor-parallel decode step of a dense model of L layers, hidden size h, vocabulary V, batch B, element size s on
N ranks makes 2L + 1 all-reduces of [B, h] (attention and MLP outputs, the embedding) and one all-gather of the
float32 logits, [B, ceil(V/N)] from each rank (bench/tp_comm.py counts them on a live engine; decode_step.py checks
the count against rank 0's CommStats before it trusts the replay).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

LLAMA_31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "bos_token_id": 128000, "eos_token_id": 128001, "dtype": "bfloat16",
}
# Qwen3-30B-A3B's shape: 48 layers of 128 experts (top-8, expert intermediate 768), 4 KV heads of 128
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "bos_token_id": 151643, "eos_token_id": 151645, "dtype": "bfloat16",
}
# the same architectures at a size a CPU runs in seconds (the script's smoke run, over gloo)
TINY_LLAMA: dict[str, Any] = {**LLAMA_31_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
                              "max_position_embeddings": 4096}
TINY_QWEN3_MOE: dict[str, Any] = {**QWEN3_30B_A3B, "hidden_size": 128, "intermediate_size": 256,
                                  "moe_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "head_dim": 32, "vocab_size": 1024, "max_position_embeddings": 4096}
SHAPES = {"llama-3.1-8b": LLAMA_31_8B, "qwen3-30b-a3b": QWEN3_30B_A3B, "tiny-llama": TINY_LLAMA,
          "tiny-qwen3-moe": TINY_QWEN3_MOE}


def shape_config(name: str, num_layers: int | None = None) -> dict[str, Any]:
    """The config.json of shape `name`, with `num_layers` layers when given (the step's per-layer work is the
    same; fewer layers load faster)."""
    config = copy.deepcopy(SHAPES[name])
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
    return config


def is_moe(config: dict[str, Any]) -> bool:
    return "num_experts" in config or "num_local_experts" in config


def decode_collectives(config: dict[str, Any], batch: int, tp_size: int) -> dict[str, Any]:
    """The collectives of one dense decode step on rank 0 (module docstring): count and bytes per kind."""
    layers, hidden, vocab = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    element = 2 if config.get("dtype") == "bfloat16" else 4
    return {"all_reduce": {"count": 2 * layers + 1, "bytes": batch * hidden * element},
            "all_gather": {"count": 1, "bytes": batch * -(-vocab // tp_size) * 4}}


def time_collectives(rank_state: dict[str, Any], batch: int, hidden: int, vocab_rows: int, num_all_reduces: int,
                     dtype_name: str, repeats: int) -> dict[str, float]:
    """Runs on every rank (an engine CALL: `runner.call_ranks("bench.tp_step:time_collectives", ...)`): the step's
    all-reduces ([batch, hidden] of `dtype_name`, `num_all_reduces` of them, one after another as the layers issue
    them) and its logits all-gather ([batch, vocab_rows] float32), on the engine's own process group and device.
    Seconds per step of each kind, the mean over `repeats` steps after a warm-up, timed on this rank."""
    import torch.distributed as dist

    device = rank_state["runner"].device
    x = torch.ones(batch, hidden, dtype=getattr(torch, dtype_name), device=device)
    logits = torch.ones(batch, vocab_rows, dtype=torch.float32, device=device)
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size())]

    def all_reduces() -> None:
        for _ in range(num_all_reduces):
            dist.all_reduce(x)

    def all_gather() -> None:
        dist.all_gather(parts, logits)

    result = {}
    for name, step in (("all_reduce", all_reduces), ("all_gather", all_gather)):
        for _ in range(3):
            step()
        result[name] = _timed(step, repeats, device) / repeats
    return result


def _timed(fn: Any, repeats: int, device: torch.device) -> float:
    """Seconds `repeats` calls of `fn` take: CUDA events on a GPU (the collectives' device time as the step's
    stream sees it), the wall clock on a CPU."""
    import torch.distributed as dist

    dist.barrier()  # every rank starts together: the first collective must not time another rank's lateness
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return time.perf_counter() - started


def read_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large reduction (reads dominate), best of several: 4 GiB of bf16 on a GPU, 256 MiB of float32
    on a CPU (the smoke run's stand-in for HBM)."""
    on_gpu = device.type == "cuda"
    num_bytes = (4 << 30) if on_gpu else (256 << 20)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    x = torch.empty(num_bytes // dtype.itemsize, dtype=dtype, device=device).normal_()
    best = float("inf")
    for _ in range(10 if on_gpu else 3):
        best = min(best, _timed_once(x.sum, device))
    del x
    return num_bytes / best


def _timed_once(fn: Any, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started
