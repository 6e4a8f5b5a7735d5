"""Builds a model: architecture lookup, then weights from safetensors (single or sharded), a GGUF file
(engine/model/gguf_loader.py) or dummy. Both checkpoint kinds arrive as (Hugging Face name, tensor) pairs, so one
loop fills the model. A tensor-parallel rank copies only its slice of each checkpoint tensor (`_rank_slice`: the
split engine/layers/linear.py describes)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.config import ModelConfig, ModelConfigError
from engine.layers.cpu_linear import pack_cpu_linears
from engine.layers.linear import HeadSplit, vocab_shard
from engine.layers.moe import SparseMoeBlock
from engine.model.gguf_loader import gguf_tensors, is_gguf_model
from engine.model.llama import LlamaForCausalLM
from engine.parallel.context import SINGLE_RANK, ParallelContext

# Every supported architecture is a variant of one decoder; the differences live in ModelConfig.
_ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
}

# checkpoint name fragment -> (our fused parameter, shard index within it)
_STACKED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
                load_format: str, seed: int, fused_kernels: bool = False,
                parallel: ParallelContext = SINGLE_RANK) -> LlamaForCausalLM:
    # Built in the serving dtype, not in float32 and then cast: for an 8B model in bf16 that peaked at 48 GB on the
    # GPU and left 32 GB in torch's cache, which another node sharing the GPU could not have (issue 45's P/D pools).
    with torch.device(device), _default_dtype(dtype):
        model = _ARCHITECTURES[cfg.architecture](cfg, max_positions, fused_kernels, parallel)
    model.to(dtype=dtype)  # the buffers computed in float32 (the rotary table) follow, as transformers' do
    # the rotary table stays float32 whatever the weights are (transformers computes it in float32)
    for module in model.modules():
        if hasattr(module, "cos_sin"):
            module.cos_sin = module.cos_sin.float()
    if load_format == "dummy":
        _init_dummy(model, seed + parallel.tp_rank)
    else:
        load_weights(model, cfg, parallel)
    if device.type == "cpu":
        pack_cpu_linears(model)  # after loading: the checkpoint fills the nn.Linear parameters by name
    elif device.type == "cuda":
        torch.cuda.empty_cache()  # the loader's temporaries: a node sized with --num-kv-blocks never profiles
    return model.eval()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _init_dummy(model: nn.Module, seed: int) -> None:
    """Random weights of the real shapes, for benchmarks: small uniform values keep activations finite.
    Drawn on the weights' own device (an 8B model drawn on the host would take minutes)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" not in name:
            param.data.uniform_(-0.02, 0.02, generator=generator)


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelConfigError(f"{index}: not a valid safetensors index ({e})") from e
        files = sorted({path / name for name in weight_map.values()})
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise ModelConfigError(f"{path}: the index names shards that are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelConfigError(f"{path}: no *.safetensors weights found (only safetensors are supported)")
    return files


def _checkpoint_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in _checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def load_weights(model: nn.Module, cfg: ModelConfig, parallel: ParallelContext = SINGLE_RANK) -> None:
    # MoE blocks place their own weights (experts stacked, split across ranks); they name what they still need
    moe_blocks = {prefix: m for prefix, m in model.named_modules() if isinstance(m, SparseMoeBlock)}
    params = {name: p for name, p in model.named_parameters() if _moe_block_of(name, moe_blocks) is None}
    # every (parameter, shard) the checkpoint must provide; shard None = the whole parameter
    missing: set[tuple[str, int | None]] = {(f"{prefix}.{slot}", None) for prefix, block in moe_blocks.items()
                                            for slot in block.checkpoint_slots()}
    for name in params:
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        num_shards = len(_shard_sizes(name, cfg, parallel)) if _is_fused(name) else 0
        missing |= {(name, i) for i in range(num_shards)} if num_shards else {(name, None)}
    tensors = gguf_tensors(cfg) if is_gguf_model(cfg) else _checkpoint_tensors(cfg.path)
    for name, tensor in tensors:
        if "rotary_emb.inv_freq" in name or (cfg.tie_word_embeddings and name == "lm_head.weight"):
            continue
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for its MoE block
        if (prefix := _moe_block_of(name, moe_blocks)) is not None:
            filled = moe_blocks[prefix].load_checkpoint_weight(name[len(prefix) + 1:], tensor)
            missing -= {(f"{prefix}.{slot}", None) for slot in filled}
            continue
        target, shard = name, None
        for fragment, (fused, index) in _STACKED.items():
            if fragment in name:
                target, shard = name.replace(fragment, fused), index
                break
        param = params.get(target)
        if param is None:
            raise ModelConfigError(f"checkpoint tensor {name!r} does not belong to {cfg.architecture}")
        dest = param.data if shard is None else _shard_of(param.data, target, shard, cfg, parallel)
        if parallel.is_parallel:
            tensor = _rank_slice(target, shard, tensor, cfg, parallel)
        if dest.shape != tensor.shape:
            raise ModelConfigError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                   f"the config implies {tuple(dest.shape)}")
        dest.copy_(tensor)
        missing.discard((target, shard))
    if missing:
        names = sorted(f"{n}[{s}]" if s is not None else n for n, s in missing)
        raise ModelConfigError(f"checkpoint lacks weights: {names[:5]}{' ...' if len(names) > 5 else ''}")


def _moe_block_of(name: str, moe_blocks: dict[str, SparseMoeBlock]) -> str | None:
    """The prefix of the MoE block a parameter or checkpoint name falls in (`model.layers.3.mlp`), if any."""
    head, sep, _ = name.partition(".mlp.")
    return head + ".mlp" if sep and head + ".mlp" in moe_blocks else None


def _is_fused(name: str) -> bool:
    return ".qkv_proj." in name or ".gate_up_proj." in name


def _shard_sizes(target: str, cfg: ModelConfig, parallel: ParallelContext = SINGLE_RANK) -> list[int]:
    """The sizes (this rank's) of a fused parameter's parts along its output rows."""
    if ".qkv_proj." in target:
        split = HeadSplit.of(cfg.num_heads, cfg.num_kv_heads, parallel.tp_rank, parallel.tp_size)
        kv = split.num_kv_heads * cfg.head_dim
        return [split.num_q_heads * cfg.head_dim, kv, kv]
    _, intermediate = parallel.shard(cfg.intermediate_size)
    return [intermediate, intermediate]


def _shard_of(data: torch.Tensor, target: str, shard: int, cfg: ModelConfig,
              parallel: ParallelContext = SINGLE_RANK) -> torch.Tensor:
    sizes = _shard_sizes(target, cfg, parallel)
    return data.narrow(0, sum(sizes[:shard]), sizes[shard])


def _rank_slice(target: str, shard: int | None, tensor: torch.Tensor, cfg: ModelConfig,
                parallel: ParallelContext) -> torch.Tensor:
    """This rank's part of a whole checkpoint tensor (`shard`: which part of a fused parameter it fills)."""
    head_dim = cfg.head_dim
    if ".qkv_proj." in target:
        split = HeadSplit.of(cfg.num_heads, cfg.num_kv_heads, parallel.tp_rank, parallel.tp_size)
        if shard == 0:
            return tensor.narrow(0, split.q_start * head_dim, split.num_q_heads * head_dim)
        return tensor.narrow(0, split.kv_start * head_dim, split.num_kv_heads * head_dim)
    if ".gate_up_proj." in target:
        return tensor.narrow(0, *parallel.shard(cfg.intermediate_size))
    is_row_parallel = ".o_proj." in target or ".down_proj." in target
    if is_row_parallel and target.endswith(".bias"):
        # the partial outputs are summed over the ranks: the bias is added by rank 0 alone
        return tensor if parallel.is_driver else torch.zeros_like(tensor)
    if ".o_proj." in target:
        split = HeadSplit.of(cfg.num_heads, cfg.num_kv_heads, parallel.tp_rank, parallel.tp_size)
        return tensor.narrow(1, split.q_start * head_dim, split.num_q_heads * head_dim)
    if ".down_proj." in target:
        return tensor.narrow(1, *parallel.shard(cfg.intermediate_size))
    if target in ("model.embed_tokens.weight", "lm_head.weight"):
        start, rows = vocab_shard(cfg.vocab_size, parallel)
        out = tensor.new_zeros((rows, *tensor.shape[1:]))  # the last rank's rows past the vocabulary stay zero
        available = max(0, min(rows, tensor.shape[0] - start))
        out[:available] = tensor[start:start + available]
        return out
    return tensor  # norms: every rank holds them whole
