"""A GGUF file's weights under Hugging Face names, dequantized to float32 on the host (the loader then copies each
into the model's dtype and device), with llama.cpp's rotary permutation of the Q/K rows undone.

Why the permutation: llama.cpp rotates interleaved pairs of head dims (x0,x1), (x2,x3), ... while our RoPE, like
transformers', rotates halves (x_i, x_{i+D/2}). Its converter reorders the rows of each head of q_proj and k_proj
so that interleaved rotation of the new rows equals rotation by halves of the old ones: within a head, row
2i comes from row i and row 2i+1 from row i + D/2. `_unpermute_rotary_rows` puts them back.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from engine.config import ModelConfig, ModelConfigError
from engine.gguf_config import open_gguf

# ggml types we dequantize; every other type is refused by name (see gguf_tensors)
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def hf_tensor_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for a name we do not know."""
    stem, _, kind = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{kind}"
    if len(parts) == 1 and parts[0] in _TOP_TENSORS:
        return f"{_TOP_TENSORS[parts[0]]}.{kind}"
    return None


def gguf_tensors(cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every tensor of the GGUF file cfg.path, one at a time."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    supported = {GGMLQuantizationType[name] for name in SUPPORTED_TENSOR_TYPES}
    for tensor in open_gguf(cfg.path).tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            raise ModelConfigError(f"{cfg.path}: GGUF tensor {tensor.name!r} does not belong to {cfg.architecture}")
        if tensor.tensor_type not in supported:
            raise ModelConfigError(f"{cfg.path}: GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}; "
                                   f"supported types: {', '.join(SUPPORTED_TENSOR_TYPES)}")
        # GGUF lists dims fastest-first; the reader's array is row-major already, only quantized rows are bytes
        shape = tuple(int(n) for n in reversed(tensor.shape))
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            values = _unpermute_rotary_rows(values, cfg.num_heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            values = _unpermute_rotary_rows(values, cfg.num_kv_heads)
        yield name, torch.from_numpy(np.array(values, order="C"))  # a copy: the file is mapped read-only


def _unpermute_rotary_rows(values: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's converter permutation of a q/k projection: values [num_heads * D, ...]."""
    head_dim = values.shape[0] // num_heads
    # the file's rows of one head are [D/2, 2] (pair index, member of the pair); ours are [2, D/2]
    by_pair = values.reshape(num_heads, head_dim // 2, 2, *values.shape[1:])
    return by_pair.swapaxes(1, 2).reshape(values.shape)


def is_gguf_model(cfg: ModelConfig) -> bool:
    """ModelConfig.path is the .gguf file for a GGUF model (gguf_config.gguf_model_config)."""
    return Path(cfg.path).suffix == ".gguf" and Path(cfg.path).is_file()
