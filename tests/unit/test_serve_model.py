"""Which model `tandem serve` runs without --model, with `--model demo`, and with a path; bad paths refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cluster.models import DEFAULT_MODEL_NAME, ModelChoiceError, resolve_model
from engine.gguf_config import smollm2_gguf_path
from tests.fixtures.tiny_models import TinyModelFactory


def test_no_model_serves_smollm2_from_its_package_under_its_short_name() -> None:
    path, name = resolve_model(None, None)
    assert path == smollm2_gguf_path().resolve() and path.suffix == ".gguf" and path.is_file()
    assert name == DEFAULT_MODEL_NAME == "smollm2-135m-instruct"
    assert resolve_model(None, "mine") == (path, "mine")


def test_demo_serves_the_random_demo_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    path, name = resolve_model("demo", None)
    assert name == "tandem-demo" and path.parent == tmp_path.resolve() and (path / "config.json").is_file()


def test_a_path_is_named_after_its_folder_or_gguf_file(tiny_model: TinyModelFactory, tmp_path: Path) -> None:
    model = tiny_model("llama")
    assert resolve_model(str(model), None) == (model.resolve(), model.name)
    copy = shutil.copy(smollm2_gguf_path(), tmp_path / "My-Model.Q4_1.gguf")
    assert resolve_model(str(copy), None) == (Path(copy).resolve(), "My-Model.Q4_1")


def test_a_path_that_is_no_model_is_refused_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(ModelChoiceError, match="--model .*no config.json"):
        resolve_model(str(tmp_path), None)
    with pytest.raises(ModelChoiceError, match="--model"):
        resolve_model(str(tmp_path / "missing"), None)
