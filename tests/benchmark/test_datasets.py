"""Workloads: synthetic prompts are token-exact under the tokenizer the server uses (transformers' here, the
oracle), reproducible from the seed, and shaped as each dataset promises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from benchmark.datasets import DatasetConfig, get_samples, load_tokenizer


@pytest.fixture(scope="module")
def oracle(tokenizer_dir: Path):  # type: ignore[no-untyped-def]
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("input_len", [1, 7, 64, 200])
def test_random_prompts_encode_to_exactly_the_asked_length(tokenizer_dir: Path, oracle, input_len: int) -> None:  # type: ignore[no-untyped-def]
    for seed in range(3):
        config = DatasetConfig(name="random", num_prompts=8, seed=seed, input_len=input_len, output_len=5)
        samples = get_samples(config, load_tokenizer(tokenizer_dir))
        assert [oracle(s.prompt) for s in samples] == [input_len] * 8
        assert {(s.prompt_len, s.expected_output_len) for s in samples} == {(input_len, 5)}


def test_ranged_lengths_stay_in_range_and_are_reported_exactly(tokenizer_dir: Path, oracle) -> None:  # type: ignore[no-untyped-def]
    config = DatasetConfig(name="random", num_prompts=20, input_len=40, output_len=10, range_ratio=0.5)
    samples = get_samples(config, load_tokenizer(tokenizer_dir))
    assert all(20 <= s.prompt_len <= 60 and 5 <= s.expected_output_len <= 15 for s in samples)
    assert [oracle(s.prompt) for s in samples] == [s.prompt_len for s in samples]
    assert len({s.prompt_len for s in samples}) > 1


def test_the_same_seed_gives_the_same_workload(tokenizer_dir: Path) -> None:
    tokenizer = load_tokenizer(tokenizer_dir)
    config = DatasetConfig(name="random", num_prompts=4, seed=3, input_len=16)
    assert get_samples(config, tokenizer) == get_samples(config, tokenizer)
    assert get_samples(config, tokenizer) != get_samples(DatasetConfig(name="random", num_prompts=4, seed=4,
                                                                       input_len=16), tokenizer)


def test_shared_prefix_groups_share_their_prefix(tokenizer_dir: Path, oracle) -> None:  # type: ignore[no-untyped-def]
    config = DatasetConfig(name="shared-prefix", num_prompts=6, input_len=8, prefix_len=32, num_prefixes=2)
    samples = get_samples(config, load_tokenizer(tokenizer_dir))
    prefix_of = [load_tokenizer(tokenizer_dir).decode(
        load_tokenizer(tokenizer_dir).encode(s.prompt, add_special_tokens=False).ids[:24]) for s in samples]
    assert prefix_of[0] == prefix_of[2] == prefix_of[4] != prefix_of[1] == prefix_of[3] == prefix_of[5]
    assert [oracle(s.prompt) for s in samples] == [s.prompt_len for s in samples]


def test_multi_turn_histories_grow_by_a_reply_and_a_user_turn(tokenizer_dir: Path) -> None:
    config = DatasetConfig(name="multi-turn", num_prompts=6, input_len=8, output_len=4, num_turns=3)
    samples = get_samples(config, load_tokenizer(tokenizer_dir))
    # two conversations, listed turn-major: [c0t0, c1t0, c0t1, c1t1, c0t2, c1t2]
    lengths = [len(s.messages or ()) for s in samples]
    assert lengths == [1, 1, 3, 3, 5, 5]
    first, second = samples[0].messages or (), samples[2].messages or ()
    assert second[:1] == first and [m.role for m in second] == ["user", "assistant", "user"]


def test_jsonl_reads_prompts_and_messages(tmp_path: Path, tokenizer_dir: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "hello there", "output_len": 3}) + "\n\n"
                    + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    samples = get_samples(DatasetConfig(name="jsonl", num_prompts=3, output_len=9, dataset_path=path),
                          load_tokenizer(tokenizer_dir))
    assert [s.prompt for s in samples] == ["hello there", "hi", "hello there"]
    assert [s.expected_output_len for s in samples] == [3, 9, 3]
    assert samples[1].messages is not None and samples[1].messages[0].content == "hi"
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match="not JSON"):
        get_samples(DatasetConfig(name="jsonl", num_prompts=1, dataset_path=path), None)
