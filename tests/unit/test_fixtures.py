"""The offline tiny-model fixtures themselves: they load with transformers and behave usefully."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.fixtures.tiny_models import (
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    TinyModelFactory,
    build_tiny_model,
    hf_greedy,
    train_tokenizer,
)

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
UNICODE_TEXT = "héllo wörld 日本語 🙂"


def test_tokenizer_round_trips_unicode_and_splits_multibyte_characters(tokenizer_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    token_ids = tokenizer.encode(UNICODE_TEXT, add_special_tokens=False)

    assert tokenizer.decode(token_ids) == UNICODE_TEXT
    pieces = [tokenizer.decode([token_id]) for token_id in token_ids]
    assert any("\ufffd" in piece for piece in pieces), "expected a character split across tokens"
    assert any(len(piece) == 1 and len(piece.encode()) > 1 for piece in pieces), "expected a multi-byte token"


def test_tokenizer_special_tokens_and_chat_template(tokenizer_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)

    assert len(tokenizer) == VOCAB_SIZE
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2]
    assert tokenizer.eos_token_id == 0
    messages = [{"role": "user", "content": "hi"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.encode(prompt, add_special_tokens=False)[0] == 1


def test_tokenizer_training_is_deterministic(tokenizer_dir: Path, tmp_path: Path) -> None:
    train_tokenizer(tmp_path)

    assert (tmp_path / "tokenizer.json").read_text() == (tokenizer_dir / "tokenizer.json").read_text()


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_loads_offline_and_greedy_output_varies(tiny_model: TinyModelFactory, arch: str) -> None:
    model_dir = tiny_model(arch)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    assert model.config.model_type == arch
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id
    prompts = [tokenizer.encode(text) for text in ("The license", "héllo", "def f(x):")]
    outputs = hf_greedy(model_dir, prompts, max_new_tokens=20)
    assert [len(output) for output in outputs] == [20, 20, 20]
    assert all(len(set(output)) > 3 for output in outputs), outputs
    assert len({tuple(output) for output in outputs}) == len(outputs)


def test_arch_specific_weights_are_present(tiny_model: TinyModelFactory) -> None:
    qwen2 = AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"))
    qwen3 = AutoModelForCausalLM.from_pretrained(tiny_model("qwen3"))

    assert qwen2.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    assert qwen3.config.head_dim * qwen3.config.num_attention_heads != qwen3.config.hidden_size
    assert qwen3.model.layers[0].self_attn.q_proj.weight.shape == (4 * 32, 64)
    assert hasattr(qwen3.model.layers[0].self_attn, "q_norm")


def test_sharded_model_writes_index_and_loads(tiny_model: TinyModelFactory) -> None:
    model_dir = tiny_model("llama", max_shard_size="50KB")

    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert hf_greedy(model_dir, [[5, 6, 7]], 5) == hf_greedy(tiny_model("llama"), [[5, 6, 7]], 5)


@pytest.mark.parametrize(
    ("overrides", "expected_rope"),
    [
        ({}, {"rope_type": "default", "rope_theta": 10000.0}),
        ({"rope_theta": 1e6}, {"rope_type": "default", "rope_theta": 1e6}),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
            {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        ),
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
            {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        ),
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 10000.0,
            },
        ),
    ],
)
def test_rope_overrides_land_in_rope_parameters(
    tiny_model: TinyModelFactory, overrides: dict[str, Any], expected_rope: dict[str, Any]
) -> None:
    config = json.loads((tiny_model("llama", **overrides) / "config.json").read_text())

    assert config["rope_parameters"] == expected_rope
    assert "rope_scaling" not in config and "rope_theta" not in config


def test_tied_embeddings_override_saves_no_lm_head(tiny_model: TinyModelFactory) -> None:
    model_dir = tiny_model("qwen3", tie_word_embeddings=True)

    assert json.loads((model_dir / "config.json").read_text())["tie_word_embeddings"] is True
    with safe_open(model_dir / "model.safetensors", framework="pt") as weights:
        assert "lm_head.weight" not in weights.keys()


def test_sliding_window_override_changes_long_prompt_output(tiny_model: TinyModelFactory) -> None:
    windowed_dir = tiny_model("mistral", sliding_window=8)
    prompt = list(range(3, 40))

    assert json.loads((windowed_dir / "config.json").read_text())["sliding_window"] == 8
    assert hf_greedy(windowed_dir, [prompt], 10) != hf_greedy(tiny_model("mistral"), [prompt], 10)


def test_build_is_deterministic(tiny_model: TinyModelFactory, tokenizer_dir: Path, tmp_path: Path) -> None:
    rebuilt_dir = build_tiny_model("qwen2", tmp_path, tokenizer_dir=tokenizer_dir)

    original = (tiny_model("qwen2") / "model.safetensors").read_bytes()
    assert (rebuilt_dir / "model.safetensors").read_bytes() == original
