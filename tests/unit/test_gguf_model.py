"""GGUF models (engine/gguf_config.py, engine/model/gguf_loader.py) on tiny GGUF files written like llama.cpp's
converter writes them: greedy tokens equal transformers' on the original model (F32) or on the same file (the other
types), the weights come back unpermuted, config and tokenizer come from the metadata, unknown types are refused."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from engine import LLM, SamplingParams
from engine.config import ModelConfig, ModelConfigError
from engine.gguf_config import _auto_dtype, find_gguf_file, smollm2_gguf_path
from engine.model.gguf_loader import gguf_tensors
from engine.tokenizer import load_tokenizer
from tests.fixtures.gguf_models import greedy, load_gguf_oracle, write_gguf
from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[17, 300, 42], [7, 99, 512, 3, 250, 600, 11, 80, 901]]

F32_MODELS = {
    "llama": {},
    "llama-tied": {"tie_word_embeddings": True},
    "llama-rope-linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
}


def greedy_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def tiny_gguf(tiny_model: TinyModelFactory, tmp_path: Path, tensor_type: str = "F32", **overrides: object) -> Path:
    return write_gguf(tiny_model("llama", **overrides), tmp_path / "gguf" / f"tiny-{tensor_type}.gguf", tensor_type)


@pytest.mark.parametrize("name", list(F32_MODELS))
def test_f32_gguf_greedy_matches_transformers_on_the_original_model(tiny_model: TinyModelFactory, tmp_path: Path,
                                                                    name: str) -> None:
    model_dir = tiny_model("llama", **F32_MODELS[name])
    gguf_file = write_gguf(model_dir, tmp_path / "gguf" / "tiny.gguf")
    llm = LLM(model=str(gguf_file), dtype="float32", block_size=4)
    assert greedy_tokens(llm, PROMPTS) == hf_greedy(model_dir, PROMPTS, GREEDY.max_tokens)


@pytest.mark.parametrize("tensor_type", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_gguf_greedy_matches_transformers_loading_the_same_file(tiny_model: TinyModelFactory, tmp_path: Path,
                                                                tensor_type: str) -> None:
    gguf_file = tiny_gguf(tiny_model, tmp_path, tensor_type)
    llm = LLM(model=str(gguf_file.parent), dtype="float32", block_size=4)  # the directory holding the file
    assert greedy_tokens(llm, PROMPTS) == greedy(load_gguf_oracle(gguf_file), PROMPTS, GREEDY.max_tokens)


def test_f32_gguf_weights_come_back_equal_to_the_original_unpermuted(tiny_model: TinyModelFactory,
                                                                      tmp_path: Path) -> None:
    model_dir = tiny_model("llama")
    cfg = ModelConfig.from_path(write_gguf(model_dir, tmp_path / "tiny.gguf"))
    original = load_file(str(model_dir / "model.safetensors"))
    loaded = dict(gguf_tensors(cfg))
    assert loaded.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(loaded[name], tensor), name


def test_config_from_metadata_equals_the_hf_config(tiny_model: TinyModelFactory, tmp_path: Path) -> None:
    model_dir = tiny_model("llama", tie_word_embeddings=True, rope_theta=50000.0)
    from_gguf = ModelConfig.from_path(write_gguf(model_dir, tmp_path / "tiny.gguf"))
    from_hf = ModelConfig.from_path(model_dir)
    assert from_gguf.tie_word_embeddings and from_gguf.rope.theta == 50000.0
    assert from_gguf.path.suffix == ".gguf" and from_gguf.config_dtype is None
    # rms_norm_eps travels as a float32 in GGUF
    assert from_gguf.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps, rel=1e-6)
    same = {"path": from_hf.path, "rms_norm_eps": from_hf.rms_norm_eps, "config_dtype": from_hf.config_dtype}
    assert ModelConfig(**{**from_gguf.__dict__, **same}) == from_hf


def test_tokenizer_and_chat_template_from_metadata_match_the_original(tiny_model: TinyModelFactory,
                                                                      tmp_path: Path) -> None:
    model_dir = tiny_model("llama")
    ours = load_tokenizer(write_gguf(model_dir, tmp_path / "tiny.gguf"))
    original = AutoTokenizer.from_pretrained(str(model_dir))
    texts = ["Hello world, this is", "héllo wörld 日本語 🙂", "<|im_start|>user\nhi<|im_end|>\n"]
    assert [ours.encode(t) for t in texts] == [original.encode(t) for t in texts]
    chat = [{"role": "user", "content": "Hello there"}]
    assert (ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            == original.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    assert ours.eos_token_id == original.eos_token_id


def test_an_unsupported_tensor_type_is_refused_by_tensor_name_and_type(tiny_model: TinyModelFactory,
                                                                       tmp_path: Path) -> None:
    gguf_file = write_gguf(tiny_model("llama"), tmp_path / "tiny.gguf",
                           tensor_types={"blk.1.ffn_norm.weight": "F64"})
    with pytest.raises(ModelConfigError, match=r"'blk\.1\.ffn_norm\.weight' has type F64; supported types: F32"):
        LLM(model=str(gguf_file), dtype="float32", skip_tokenizer_init=True)


def test_gguf_detection_file_directory_and_hf_directory(tiny_model: TinyModelFactory, tmp_path: Path) -> None:
    gguf_file = write_gguf(tiny_model("llama"), tmp_path / "one" / "tiny.gguf")
    assert find_gguf_file(gguf_file) == gguf_file
    assert find_gguf_file(gguf_file.parent) == gguf_file
    hf_dir = tmp_path / "hf"
    shutil.copytree(tiny_model("llama"), hf_dir)
    shutil.copy(gguf_file, hf_dir / "tiny.gguf")
    assert find_gguf_file(hf_dir) is None  # a config.json makes it a Hugging Face directory
    assert ModelConfig.from_path(hf_dir).path == hf_dir
    shutil.copy(gguf_file, gguf_file.parent / "second.gguf")
    with pytest.raises(ModelConfigError, match="holds 2 .gguf files"):
        ModelConfig.from_path(gguf_file.parent)


def test_reading_a_gguf_config_imports_no_torch(tiny_model: TinyModelFactory, tmp_path: Path) -> None:
    gguf_file = write_gguf(tiny_model("llama"), tmp_path / "tiny.gguf")
    code = ("import sys; from engine.config import ModelConfig; "
            f"assert ModelConfig.from_path({str(gguf_file)!r}).num_layers == 2; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], check=True)


def test_auto_runs_a_quantized_file_in_bfloat16_and_a_float_file_in_its_own_dtype() -> None:
    # SmolLM2's file is Q4_1 (llama.cpp file type 3)
    assert ModelConfig.from_path(smollm2_gguf_path()).config_dtype == "bfloat16"
    assert [_auto_dtype(t) for t in (0, 1, 32, 2, 7)] == ["float32", "float16", "bfloat16", "bfloat16", "bfloat16"]
    assert _auto_dtype(None) is None  # no file type: the engine's float32
