"""Bad input gets a clear error, never a crash or a half-run batch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.config import ModelConfigError
from tests.fixtures.tiny_models import TinyModelFactory


@pytest.fixture(scope="module")
def llm(tiny_model: TinyModelFactory) -> LLM:
    return LLM(model=str(tiny_model("llama")), dtype="float32")


def test_empty_prompt_is_rejected(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate("", SamplingParams())


def test_prompt_longer_than_the_context_is_rejected(llm: LLM) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * 300], SamplingParams())


def test_token_ids_outside_the_vocabulary_are_rejected(llm: LLM) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 100_000]], SamplingParams())


def test_a_first_token_outside_the_vocabulary_is_refused_and_the_engine_runs_on(llm: LLM) -> None:
    """A decode node's first token comes from the wire: one beyond the vocabulary used to reach a step and end the
    engine thread (found by tests/integration/test_fuzz_nodes.py)."""
    from engine.sampler import SampledToken

    engine = llm.engine
    request = engine.make_request("remote", [5, 6, 7], SamplingParams(max_tokens=2))
    assert engine.reserve_remote_kv(request) is not None
    with pytest.raises(ValueError, match="first token id 100000 is outside the vocabulary"):
        engine.admit_remote_kv("remote", SampledToken(100_000))
    assert engine.abort("remote") and not engine.requests
    assert len(llm.generate([[5, 6]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2


def test_a_bad_prompt_fails_the_call_before_any_work(llm: LLM) -> None:
    with pytest.raises(ValueError):
        llm.generate([[5, 6], []], SamplingParams())
    assert not llm.engine.has_unfinished() and not llm.engine.requests


@pytest.mark.parametrize("kwargs, field", [
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -0.1}, "temperature"), ({"n": 0}, "n"),
    ({"top_k": -2}, "top_k"), ({"min_p": 2.0}, "min_p"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 3.0}, "presence_penalty"), ({"logprobs": -1}, "logprobs"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"stop": [""]}, "stop"),
    # NaN passes every range check, an infinite temperature or penalty makes NaN logits (found by
    # tests/integration/test_fuzz_nodes.py: a NaN temperature over gRPC was served)
    ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"), ({"min_p": float("nan")}, "min_p"),
])
def test_bad_sampling_params_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_missing_model_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="not a directory"):
        LLM(model=str(tmp_path / "nope"))


def test_unsupported_architecture(tiny_model: TinyModelFactory, tmp_path: Path) -> None:
    model = shutil.copytree(tiny_model("llama"), tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match="unsupported architecture"):
        LLM(model=str(model))


def test_bad_config_values(tiny_model: TinyModelFactory, tmp_path: Path) -> None:
    model = shutil.copytree(tiny_model("llama"), tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    config["num_key_value_heads"] = 3  # 4 heads are not a multiple of 3
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match="num_key_value_heads"):
        LLM(model=str(model))
    (model / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        LLM(model=str(model))


def test_missing_weights(tiny_model: TinyModelFactory, tmp_path: Path) -> None:
    model = shutil.copytree(tiny_model("llama"), tmp_path / "m")
    for f in model.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelConfigError, match="no \\*.safetensors"):
        LLM(model=str(model))


def test_dummy_weights_need_no_checkpoint(tiny_model: TinyModelFactory, tmp_path: Path) -> None:
    model = shutil.copytree(tiny_model("qwen3"), tmp_path / "m")
    for f in model.glob("*.safetensors"):
        f.unlink()
    out = LLM(model=str(model), load_format="dummy").generate([[5, 6, 7]], SamplingParams(max_tokens=4,
                                                                                          ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_bad_engine_options() -> None:
    with pytest.raises(ValueError, match="dtype"):
        LLM(model="x", dtype="int8")
    with pytest.raises(ValueError, match="block_size"):
        LLM(model="x", block_size=12)
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(model="x", attention_backend="magic")
