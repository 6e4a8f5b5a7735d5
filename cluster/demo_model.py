"""The demo model `tandem serve` runs when no --model is given: built on this machine on first use, no download.

A random-weight Llama (small enough to serve on a laptop CPU) with a byte-level BPE tokenizer trained on text
that ships with Python, and a ChatML chat template. Its output is gibberish, but every part of the serving path
(tokenizer, chat template, prefill, KV transfer, decode, detokenization) runs for real.

The build is deterministic (fixed seeds, fixed training text) and atomic: it happens in a temporary folder that
is renamed into place, so two first runs at once never leave a half-written model; the loser of the race keeps
the winner's copy.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cluster.progress import Progress
from cluster.state import cache_dir

logger = logging.getLogger(__name__)

# Bump when the recipe below changes: a new version builds into a new folder.
DEMO_MODEL_VERSION = "v1"
DEMO_MODEL_NAME = "tandem-demo"  # the name clients send when `tandem serve` runs it

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Modules whose docstrings (with Python's LICENSE) make the tokenizer's training text.
_CORPUS_MODULES = ("os", "json", "re", "typing", "collections", "functools", "pathlib", "argparse", "asyncio",
                   "dataclasses", "itertools", "logging", "subprocess", "threading", "unittest", "email")


@dataclass(frozen=True)
class DemoModelSpec:
    """The model's shape. The vocabulary size is the trained tokenizer's (at most `vocab_size`)."""

    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 688
    vocab_size: int = 4096
    max_position_embeddings: int = 2048
    seed: int = 0


def demo_model_path(root: Path | None = None) -> Path:
    return (root or cache_dir()) / f"demo-model-{DEMO_MODEL_VERSION}"


def ensure_demo_model(root: Path | None = None, spec: DemoModelSpec | None = None) -> Path:
    """The demo model's folder, built first if it does not exist yet."""
    final = demo_model_path(root)
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build_demo_model(staging, spec or DemoModelSpec())
        try:
            os.rename(staging, final)  # atomic; fails if another build got there first
        except OSError:
            if not (final / "config.json").is_file():
                raise
            logger.info("another process built the demo model first; using its copy")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def build_demo_model(out_dir: Path, spec: DemoModelSpec) -> Path:
    """Writes tokenizer, config and random weights into out_dir (which must exist)."""
    steps = 2 + spec.num_layers + 1
    with Progress("building the demo model", total=steps) as progress:
        vocab_size = _train_tokenizer(out_dir, spec)
        progress.advance()
        _write_config(out_dir, spec, vocab_size)
        progress.advance()
        _write_weights(out_dir, spec, vocab_size, progress)
    return out_dir


def _corpus() -> list[str]:
    texts = []
    license_path = Path(os.__file__).parent / "LICENSE.txt"
    if license_path.is_file():
        texts.append(license_path.read_text(encoding="utf-8"))
    for name in _CORPUS_MODULES:
        texts.append(importlib.import_module(name).__doc__ or "")
    texts.append("Hello! How can I help you today? The quick brown fox jumps over the lazy dog. 0123456789")
    return texts


def _train_tokenizer(out_dir: Path, spec: DemoModelSpec) -> int:
    """Trains and saves the tokenizer; returns its vocabulary size. Ids: <|endoftext|> 0 (eos and pad),
    <|im_start|> 1, <|im_end|> 2; no bos token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "model_max_length": spec.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return int(tokenizer.get_vocab_size())


def _write_config(out_dir: Path, spec: DemoModelSpec, vocab_size: int) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.hidden_size // spec.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
        "bos_token_id": None,
        "eos_token_id": 0,
        "pad_token_id": None,
        "dtype": "float32",
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}, indent=2) + "\n")


def _write_weights(out_dir: Path, spec: DemoModelSpec, vocab_size: int, progress: Progress) -> None:
    from safetensors.numpy import save_file

    rng = np.random.Generator(np.random.PCG64(spec.seed))
    hidden, head_dim = spec.hidden_size, spec.hidden_size // spec.num_heads

    def linear(out_features: int, in_features: int) -> np.ndarray:
        # std 1/sqrt(fan_in) keeps activations at unit scale through the layers
        return (rng.standard_normal((out_features, in_features), dtype=np.float32) / np.sqrt(in_features)
                ).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(hidden, dtype=np.float32)).astype(np.float32)

    tensors: dict[str, np.ndarray] = {"model.embed_tokens.weight": rng.standard_normal((vocab_size, hidden),
                                                                                        dtype=np.float32)}
    for i in range(spec.num_layers):
        prefix = f"model.layers.{i}"
        tensors |= {
            f"{prefix}.input_layernorm.weight": norm(),
            f"{prefix}.self_attn.q_proj.weight": linear(spec.num_heads * head_dim, hidden),
            f"{prefix}.self_attn.k_proj.weight": linear(spec.num_kv_heads * head_dim, hidden),
            f"{prefix}.self_attn.v_proj.weight": linear(spec.num_kv_heads * head_dim, hidden),
            f"{prefix}.self_attn.o_proj.weight": linear(hidden, spec.num_heads * head_dim),
            f"{prefix}.post_attention_layernorm.weight": norm(),
            f"{prefix}.mlp.gate_proj.weight": linear(spec.intermediate_size, hidden),
            f"{prefix}.mlp.up_proj.weight": linear(spec.intermediate_size, hidden),
            f"{prefix}.mlp.down_proj.weight": linear(hidden, spec.intermediate_size),
        }
        progress.advance()
    tensors["model.norm.weight"] = norm()
    # a sharper output layer than 1/sqrt(hidden): sampled text varies instead of being near-uniform noise
    tensors["lm_head.weight"] = linear(vocab_size, hidden) * np.float32(4.0)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    progress.advance()
