"""bench/gpu_cluster.py's pieces that decide what runs on the GPU: the 8B-shaped model directory, the memory split
between the nodes, and the correctness verdict. (The whole script runs end to end with `--tiny --device cpu`; that
takes minutes on a shared 2-core box, too long for the suite.)"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from bench.gpu_cluster_checks import Completion, compare_outputs
from bench.gpu_cluster_plan import GIB, kv_block_bytes, split_kv_blocks
from bench.gpu_cluster_report import markdown_report
from bench.shape_model import LLAMA8B_SHAPE_DIR, num_parameters, write_tiny
from engine.config import ModelConfig


def test_the_8b_shape_is_llama_3_1_8b_with_a_vocabulary_every_id_of_which_detokenizes() -> None:
    config = AutoConfig.from_pretrained(LLAMA8B_SHAPE_DIR, local_files_only=True)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size) == (4096, 32, 32, 8, 14336)
    assert config.rope_parameters["rope_type"] == "llama3" and config.max_position_embeddings >= 16384
    tokenizer = AutoTokenizer.from_pretrained(LLAMA8B_SHAPE_DIR, local_files_only=True)
    assert config.vocab_size == len(tokenizer) == 49152
    rng = random.Random(0)
    ids = [rng.randrange(config.vocab_size) for _ in range(2000)] + [config.vocab_size - 1]
    assert all(isinstance(tokenizer.decode([i]), str) for i in ids)
    assert tokenizer.decode(tokenizer("The capital of France is")["input_ids"]) == "The capital of France is"
    assert ModelConfig.from_path(LLAMA8B_SHAPE_DIR).rope.rope_type == "llama3"  # the engine reads it too


def test_the_8b_shape_directory_is_config_and_tokenizer_only_and_small() -> None:
    files = sorted(p.name for p in LLAMA8B_SHAPE_DIR.iterdir())
    assert files == ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    assert sum(p.stat().st_size for p in LLAMA8B_SHAPE_DIR.iterdir()) < 5 << 20


@pytest.mark.parametrize("tiny", [False, True])
def test_parameter_count_matches_the_transformers_model(tiny: bool, tmp_path: Path) -> None:
    model_dir = write_tiny(tmp_path / "tiny") if tiny else LLAMA8B_SHAPE_DIR
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):  # shapes only: no memory for 7 B parameters
        model = AutoModelForCausalLM.from_config(config)
    assert num_parameters(model_dir) == sum(p.numel() for p in model.parameters())


def test_an_8b_kv_block_of_16_bf16_tokens_is_2_mib() -> None:
    # 32 layers x (K, V) x 16 tokens x 8 KV heads x 128 dims x 2 bytes
    assert kv_block_bytes(LLAMA8B_SHAPE_DIR, 16, 2) == 32 * 2 * 16 * 8 * 128 * 2 == 2 << 20


def test_kv_memory_split_leaves_each_node_its_weights_and_reserve() -> None:
    block = 2 << 20
    prefill, decode, alone = split_kv_blocks(100 * GIB, 20 * GIB, block, 0.25)
    # P/D: 100 - 2 x 20 = 60 GiB of KV = 30720 blocks, a quarter for P; alone: 80 GiB = 40960 blocks
    assert (prefill, decode, alone) == (7680, 23040, 40960)
    with pytest.raises(SystemExit, match="leave no KV memory"):
        split_kv_blocks(30 * GIB, 20 * GIB, block, 0.25)
    with pytest.raises(SystemExit, match="prefill-kv-share"):
        split_kv_blocks(100 * GIB, 20 * GIB, block, 1.0)


def completion(tokens: list[str], logprobs: list[float] | None = None, prompt: str = "p") -> Completion:
    return Completion(prompt, "".join(tokens), tokens, logprobs or [-1.0] * len(tokens))


def test_outputs_equal_token_for_token_pass() -> None:
    a = [completion(["a", "b", "c"], prompt="1"), completion(["d", "e", "f"], prompt="2")]
    ok, lines = compare_outputs(a, list(a), max_tokens=3, logprob_tolerance=0.05)
    assert ok and all(line.startswith("OK") for line in lines)


@pytest.mark.parametrize("colocated, reason", [
    (completion(["a", "x", "c"]), "first differing token at 1"),
    (completion(["a", "b"]), "2 tokens"),  # the P/D side is judged on its own length too
    (completion(["a", "b", "c"], [-1.0, -1.0, -1.2]), "max |logprob diff| 2.00e-01"),
])
def test_a_different_token_a_short_output_or_a_logprob_drift_fails(colocated: Completion, reason: str) -> None:
    pd = [completion(["a", "b", "c"])]
    if reason == "2 tokens":
        pd = [completion(["a", "b"])]
    ok, lines = compare_outputs(pd, [colocated], max_tokens=3, logprob_tolerance=0.05)
    assert not ok and lines[0].startswith("FAIL") and reason in lines[0]


def test_outputs_that_ignore_their_prompt_are_flagged() -> None:
    same = [completion(["a", "a", "a"], prompt="1"), completion(["a", "a", "a"], prompt="2")]
    ok, lines = compare_outputs(same, list(same), max_tokens=3, logprob_tolerance=0.05)
    assert ok and any("repeats one token" in line for line in lines)
    assert any("two prompts gave the same output" in line for line in lines)


def test_report_pairs_modes_per_point_and_states_the_verdict() -> None:
    point = {"input_len": 1024, "output_len": 256, "concurrency": 16, "num_prompts": 32}
    data = json.loads(json.dumps({
        "plan": {"model": "/x/llama8b-shape", "dtype": "bfloat16", "device": "cuda", "kv_backend": "ipc",
                 "correctness_tokens": 32},
        "device_info": {"gpu": "NVIDIA H200"},
        "correctness": {"ok": False, "report": ["FAIL 'p': 32 tokens"]},
        "latency": [{"mode": "P/D", "prompt_len": 1024, "ttft_ms": 80.0, "first_to_second_ms": 12.5},
                    {"mode": "colocated", "prompt_len": 1024, "ttft_ms": 70.0, "first_to_second_ms": 8.0}],
        "serving": [{**point, "mode": "colocated", "output_throughput": 900.0, "failed": 0},
                    {**point, "mode": "pd", "output_throughput": 1000.0, "failed": 0}],
        "hf_generate": [{"batch_size": 16, "input_len": 1024, "output_len": 256, "output_throughput": 150.0}],
        "errors": [], "elapsed_s": 1.0}))
    report = markdown_report(data)
    assert "NVIDIA H200" in report and "**FAIL**" in report and "adds 4.5 ms" in report
    rows = [line for line in report.splitlines() if line.startswith("| 1024 / 256")]
    assert [r.split(" | ")[3] for r in rows] == ["P/D", "colocated", "transformers generate"]
    assert "1,000" in rows[0] and "900" in rows[1] and "150" in rows[2]
