"""The demo model `tandem serve` builds on first use: deterministic, atomic, and loadable by the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster import demo_model
from cluster.demo_model import DemoModelSpec, build_demo_model, demo_model_path, ensure_demo_model
from engine.config import ModelConfig

SMALL = DemoModelSpec(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                      vocab_size=400, max_position_embeddings=128)


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_two_fresh_builds_write_the_same_files(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = files(build_demo_model(tmp_path / "a", SMALL))
    second = files(build_demo_model(tmp_path / "b", SMALL))
    assert set(first) == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                          "tokenizer_config.json"}
    assert first == second


def test_the_demo_model_is_a_llama_with_a_chat_template_the_engine_reads(tmp_path: Path) -> None:
    folder = build_demo_model(tmp_path, SMALL)
    model = ModelConfig.from_path(folder)
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    assert model.architecture == "LlamaForCausalLM" and model.num_layers == SMALL.num_layers
    assert model.vocab_size == len(vocab) <= SMALL.vocab_size  # special tokens included
    assert "<|im_start|>" in json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]


def test_ensure_builds_once_in_the_cache_dir_and_leaves_no_staging_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    path = ensure_demo_model(spec=SMALL)
    assert path == demo_model_path() == tmp_path / path.name and (path / "model.safetensors").is_file()
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model(spec=SMALL) == path and (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_a_build_that_loses_the_race_keeps_the_winners_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    calls = []

    def slow_build(out_dir: Path, spec: DemoModelSpec) -> Path:
        calls.append(out_dir)
        if len(calls) == 1:  # another process finishes first, while this build is under way
            winner = ensure_demo_model(tmp_path, spec)
            (winner / "winner").write_text("")
        return build_demo_model(out_dir, spec)

    monkeypatch.setattr(demo_model, "build_demo_model", slow_build)
    path = demo_model.ensure_demo_model(tmp_path, SMALL)
    assert len(calls) == 2 and (path / "winner").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
