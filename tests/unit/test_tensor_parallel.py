"""Tensor parallelism on CPU (gloo, float32): greedy tokens equal transformers' token for token with two ranks for
each dense architecture, and the head split is the arithmetic the layers rely on."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.layers.linear import HeadSplit
from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

# the tiny models have 4 query heads and 2 KV heads: one KV head per rank
MODELS = {
    # Llama with one KV head for two ranks (replicated), biases on o_proj and down_proj (added once, by rank 0)
    # and tied embeddings (the lm_head's vocabulary rows are the embedding's)
    "llama-replicated-kv-biases-tied": ("llama", {"num_key_value_heads": 1, "attention_bias": True,
                                                  "mlp_bias": True, "tie_word_embeddings": True}),
    "qwen2-qkv-bias": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", {}),
}
# asynchronous scheduling: a decode row's input is the last step's sample on rank 0, broadcast to the others
ASYNC = {"qwen3-qk-norm"}


@pytest.mark.parametrize("name", list(MODELS))
def test_two_ranks_decode_greedy_tokens_equal_to_transformers(tiny_model: TinyModelFactory, name: str) -> None:
    arch, overrides = MODELS[name]
    model = tiny_model(arch, **overrides)
    llm = LLM(model=str(model), dtype="float32", block_size=4, max_num_batched_tokens=12, tensor_parallel_size=2,
              async_scheduling=name in ASYNC)
    try:
        rng = random.Random(0)
        vocab = llm.engine.model_config.vocab_size
        # a one-token prompt, one of several blocks, and one prefilled in two chunks (max_num_batched_tokens)
        prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 9, 14)]
        outputs = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(model, prompts, GREEDY.max_tokens)
        parallel = llm.engine.runner.parallel
        assert parallel.tp_size == 2
        # one all-reduce per attention and per MLP block of each step's 2 layers, and the embedding's
        assert parallel.stats.by_kind["all_reduce"] % 5 == 0
        assert (parallel.stats.by_kind.get("broadcast", 0) > 0) == (name in ASYNC)
    finally:
        llm.close()


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "tp_size", "expected"), [
    # (q_start, num_q_heads, kv_start, num_kv_heads) per rank
    (8, 4, 2, [(0, 4, 0, 2), (4, 4, 2, 2)]),
    (8, 2, 4, [(0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)]),  # KV heads replicated on rank pairs
    (4, 1, 2, [(0, 2, 0, 1), (2, 2, 0, 1)]),
])
def test_head_split_gives_each_rank_its_query_heads_and_the_kv_heads_they_read(
        num_heads: int, num_kv_heads: int, tp_size: int, expected: list[tuple[int, int, int, int]]) -> None:
    splits = [HeadSplit.of(num_heads, num_kv_heads, rank, tp_size) for rank in range(tp_size)]
    assert [(s.q_start, s.num_q_heads, s.kv_start, s.num_kv_heads) for s in splits] == expected
    group = num_heads // num_kv_heads  # query heads per KV head (GQA)
    for s in splits:  # every query head of a rank reads a KV head the rank holds
        assert all(s.kv_start <= q // group < s.kv_start + s.num_kv_heads for q in range(s.q_start,
                                                                                       s.q_start + s.num_q_heads))


def test_a_head_count_that_does_not_split_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="6 KV heads do not split over 4"):
        HeadSplit.of(12, 6, 0, 4)
    with pytest.raises(ValueError, match="attention heads do not split"):
        HeadSplit.of(6, 2, 0, 4)


def test_a_model_whose_heads_do_not_split_is_refused_before_any_worker_starts(tiny_model: TinyModelFactory) -> None:
    # 4 attention heads over 3 ranks
    with pytest.raises(ValueError, match="4 attention heads do not split over 3 tensor-parallel ranks"):
        LLM(model=str(tiny_model("qwen2")), dtype="float32", tensor_parallel_size=3)
