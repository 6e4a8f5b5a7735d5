"""Mixture-of-experts models on one rank: greedy tokens equal transformers' (float32) token for token for
Qwen2-MoE (shared expert, a dense layer among sparse ones), Qwen3-MoE and Mixtral; their configs parse as
transformers reads them; a checkpoint that lacks an expert is refused with a clear error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from engine import LLM, SamplingParams
from engine.config import ModelConfig, ModelConfigError
from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy_cached

ARCHS = ("qwen2_moe", "qwen3_moe", "mixtral")
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# one length, so transformers decodes them as one cached batch (its MoE forward is slow on CPU)
PROMPTS = [[17, 250, 3, 999, 42, 7], [600, 601, 602, 5, 88, 140], [901, 13, 13, 77, 402, 333]]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(tiny_model: TinyModelFactory, arch: str) -> None:
    model = tiny_model(arch)
    llm = LLM(model=str(model), dtype="float32", block_size=4, max_num_batched_tokens=8)  # chunked prefill too
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    expected = hf_greedy_cached(model, PROMPTS, MAX_TOKENS)
    assert len({t for row in expected for t in row}) > 4, "the oracle's output should not be one repeated token"
    assert tokens == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_config_is_read_as_transformers_reads_it(tiny_model: TinyModelFactory, arch: str) -> None:
    model = tiny_model(arch)
    hf = AutoConfig.from_pretrained(model)
    moe = ModelConfig.from_path(model).moe
    assert moe is not None
    is_mixtral = arch == "mixtral"
    assert moe.num_experts == (hf.num_local_experts if is_mixtral else hf.num_experts)
    assert moe.num_experts_per_tok == hf.num_experts_per_tok
    assert moe.intermediate_size == (hf.intermediate_size if is_mixtral else hf.moe_intermediate_size)
    assert moe.norm_topk_prob == (True if is_mixtral else hf.norm_topk_prob)
    assert moe.shared_expert_intermediate_size == getattr(hf, "shared_expert_intermediate_size", 0)
    sparse = [i for i in range(hf.num_hidden_layers) if moe.is_sparse_layer(i)]
    expected_sparse = list(range(hf.num_hidden_layers)) if is_mixtral else [
        i for i in range(hf.num_hidden_layers)
        if i not in hf.mlp_only_layers and (i + 1) % hf.decoder_sparse_step == 0]
    assert sparse == expected_sparse


def test_more_experts_per_token_than_experts_is_a_config_error(tiny_model: TinyModelFactory) -> None:
    raw = json.loads((tiny_model("qwen3_moe") / "config.json").read_text())
    raw["num_experts_per_tok"] = raw["num_local_experts"] + 1
    with pytest.raises(ModelConfigError, match="num_experts_per_tok"):
        ModelConfig.from_dict(Path("."), raw)


def test_a_checkpoint_missing_an_expert_is_refused(tiny_model: TinyModelFactory, tmp_path: Path) -> None:
    source = tiny_model("mixtral")
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelConfigError, match=r"lacks weights: .*layers\.1\.mlp\.experts\.3\.up"):
        LLM(model=str(tmp_path), dtype="float32")


def test_expert_parallel_flags_reach_the_engine_config_with_vllms_defaults() -> None:
    import argparse

    from node_common.options import add_node_args, engine_config, parse_node_args

    parser = argparse.ArgumentParser()
    add_node_args(parser)
    flagged = engine_config(parse_node_args(parser, ["--model", "/m", "--port", "1", "--enable-expert-parallel",
                                                     "--all2all-backend", "all_to_all"]))
    plain = engine_config(parse_node_args(parser, ["--model", "/m", "--port", "1"]))
    assert (flagged.enable_expert_parallel, flagged.all2all_backend) == (True, "all_to_all")
    assert (plain.enable_expert_parallel, plain.all2all_backend) == (False, "allgather_reducescatter")


def test_an_unknown_all2all_backend_is_refused() -> None:
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="all2all_backend must be one of"):
        EngineConfig(model="/m", all2all_backend="pplx")
