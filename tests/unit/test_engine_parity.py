"""Greedy tokens equal transformers' (float32) token for token: every architecture, chunked prefill,
prefix-cache hits, preemption, and a request admitted with its prompt K/V already in place."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.llm_engine import LLMEngine
from engine.request import RequestStatus
from engine.sampler import SampledToken
from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

MODELS = {
    "llama": ("llama", {}),
    "llama-rope-llama3": ("llama", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "llama-rope-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-tied-sharded": ("llama", {"tie_word_embeddings": True, "max_shard_size": "50KB"}),
    "mistral-sliding-window": ("mistral", {"sliding_window": 8}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
}


def mixed_prompts(vocab_size: int, lengths: tuple[int, ...] = (1, 3, 9, 17, 30), seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def greedy_tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_matches_transformers_for_a_mixed_batch(tiny_model: TinyModelFactory, name: str,
        async_scheduling: bool) -> None:
    arch, overrides = MODELS[name]
    model = tiny_model(arch, **overrides)
    llm = LLM(model=str(model), dtype="float32", block_size=4, async_scheduling=async_scheduling)
    prompts = mixed_prompts(llm.engine.model_config.vocab_size)
    assert greedy_tokens(llm, prompts) == hf_greedy(model, prompts, GREEDY.max_tokens)


def test_text_prompts_are_tokenized_like_transformers(tiny_model: TinyModelFactory, async_scheduling: bool) -> None:
    model = tiny_model("llama")
    llm = LLM(model=str(model), dtype="float32", async_scheduling=async_scheduling)
    texts = ["Hello world, this is", "héllo wörld 日本語 🙂"]
    outputs = llm.generate(texts, GREEDY)
    tokenizer = llm.get_tokenizer()
    ids = [tokenizer.encode(t) for t in texts]
    assert [o.prompt_token_ids for o in outputs] == ids
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(model, ids, GREEDY.max_tokens)
    for o in outputs:
        assert o.outputs[0].text == tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("budget", [1, 5])
def test_chunked_prefill_at_a_tiny_token_budget_matches(tiny_model: TinyModelFactory, budget: int,
        async_scheduling: bool) -> None:
    model = tiny_model("qwen3")
    llm = LLM(model=str(model), dtype="float32", block_size=4, max_num_batched_tokens=budget,
              async_scheduling=async_scheduling)
    prompts = mixed_prompts(llm.engine.model_config.vocab_size, lengths=(7, 13, 2))
    assert greedy_tokens(llm, prompts) == hf_greedy(model, prompts, GREEDY.max_tokens)


def test_prefix_cache_hits_on_the_second_run_and_still_matches(tiny_model: TinyModelFactory,
        async_scheduling: bool) -> None:
    model = tiny_model("llama")
    llm = LLM(model=str(model), dtype="float32", block_size=4, async_scheduling=async_scheduling)
    vocab = llm.engine.model_config.vocab_size
    shared = mixed_prompts(vocab, lengths=(18,), seed=1)[0]
    prompts = [shared + tail for tail in mixed_prompts(vocab, lengths=(1, 5, 9), seed=2)]
    first = llm.generate(prompts[:1], GREEDY)
    assert first[0].num_cached_tokens == 0
    second = llm.generate(prompts, GREEDY)
    # blocks of the shared 18-token prefix (4 full blocks of 4) come from the cache
    assert [o.num_cached_tokens for o in second] == [16, 16, 16]
    assert [o.outputs[0].token_ids for o in second] == hf_greedy(model, prompts, GREEDY.max_tokens)
    assert first[0].outputs[0].token_ids == second[0].outputs[0].token_ids


def test_a_full_prefix_hit_still_recomputes_the_last_token(tiny_model: TinyModelFactory,
        async_scheduling: bool) -> None:
    model = tiny_model("llama")
    llm = LLM(model=str(model), dtype="float32", block_size=4, async_scheduling=async_scheduling)
    prompt = mixed_prompts(llm.engine.model_config.vocab_size, lengths=(16,))[0]  # exactly 4 blocks
    a = llm.generate([prompt], GREEDY)[0]
    b = llm.generate([prompt], GREEDY)[0]
    assert b.num_cached_tokens == 12  # 3 of 4 blocks: the last token's logits are needed
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == hf_greedy(model, [prompt], 10)[0]


def test_preemption_with_a_tiny_pool_still_matches(tiny_model: TinyModelFactory, async_scheduling: bool) -> None:
    model = tiny_model("qwen2")
    # 12 blocks of 4 tokens: four 9-token prompts + 10 outputs each cannot all fit at once
    llm = LLM(model=str(model), dtype="float32", block_size=4, num_kv_blocks=12,
              async_scheduling=async_scheduling)
    prompts = mixed_prompts(llm.engine.model_config.vocab_size, lengths=(9, 9, 9, 9), seed=3)
    assert greedy_tokens(llm, prompts) == hf_greedy(model, prompts, GREEDY.max_tokens)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.num_free_blocks == 12


def test_request_admitted_with_its_prompt_kv_in_place_matches(tiny_model: TinyModelFactory,
        async_scheduling: bool) -> None:
    """What a decode node does: the prompt's K/V arrive from elsewhere; it continues from the first token."""
    model = tiny_model("llama")
    prefill = LLMEngine(_config(model, async_scheduling))
    decode = LLMEngine(_config(model, async_scheduling))
    prompt = mixed_prompts(prefill.model_config.vocab_size, lengths=(11,), seed=4)[0]

    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    # the prefill side keeps the prompt's blocks after it finishes, for the transfer
    request = prefill.add_request("p", prompt, first, pin_blocks=True)
    while prefill.has_unfinished():
        prefill.step()
    assert request.status is RequestStatus.FINISHED_PINNED
    first_token = request.token_ids[-1]
    pinned = prefill.pinned_blocks("p")
    assert pinned is not None and len(pinned.block_ids) == 3 and pinned.num_tokens == 11
    assert prefill.kv.num_free_blocks == prefill.kv.num_blocks - 3

    incoming = decode.make_request("d", prompt, GREEDY)
    reserved = decode.reserve_remote_kv(incoming)
    assert reserved is not None and reserved.num_cached_blocks == 0
    assert incoming.status is RequestStatus.WAITING_FOR_REMOTE_KV and not decode.has_unfinished()
    decode.kv_cache[reserved.block_ids] = prefill.kv_cache[list(pinned.block_ids)]
    assert prefill.free_pinned("p") and prefill.pinned_blocks("p") is None
    assert prefill.kv.num_free_blocks == prefill.kv.num_blocks
    assert not decode.admit_remote_kv("d", SampledToken(first_token)).finished
    while decode.has_unfinished():
        decode.step()
    expected = hf_greedy(model, [prompt], GREEDY.max_tokens)[0]
    assert incoming.output_token_ids == expected
    assert decode.kv.num_free_blocks == decode.kv.num_blocks and not decode.requests


def _config(model: Path, async_scheduling: bool):  # type: ignore[no-untyped-def]
    from engine.config import EngineConfig
    return EngineConfig(model=str(model), dtype="float32", block_size=4, async_scheduling=async_scheduling)


def test_bfloat16_runs_close_to_float32(tiny_model: TinyModelFactory, async_scheduling: bool) -> None:
    model = tiny_model("llama")
    prompts = mixed_prompts(1000, lengths=(5, 12))
    reference = greedy_tokens(LLM(model=str(model), dtype="float32", async_scheduling=async_scheduling), prompts)
    bf16 = LLM(model=str(model), dtype="bfloat16", async_scheduling=async_scheduling)
    assert bf16.engine.runner.kv_cache.dtype == torch.bfloat16
    tokens = greedy_tokens(bf16, prompts)
    # bf16 may flip a near-tie later on; the first tokens must agree
    assert [t[:2] for t in tokens] == [t[:2] for t in reference]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_backend_interpreted_matches_transformers(tiny_model: TinyModelFactory, arch: str,
        async_scheduling: bool) -> None:
    """The real Triton attention kernels, run by Triton's CPU interpreter, through the whole engine:
    prefill chunks with a cached prefix, then batched decode."""
    model = tiny_model(arch)
    llm = LLM(model=str(model), dtype="float32", block_size=4, max_num_batched_tokens=8,
              attention_backend="triton", async_scheduling=async_scheduling)
    assert type(llm.engine.runner.backend).__name__ == "TritonAttention"
    prompts = mixed_prompts(llm.engine.model_config.vocab_size, lengths=(3, 11))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert greedy_tokens(llm, prompts, params) == hf_greedy(model, prompts, 4)
    again = llm.generate(prompts[1:], params)[0]  # served partly from the prefix cache
    assert again.num_cached_tokens == 8 and again.outputs[0].token_ids == hf_greedy(model, prompts[1:], 4)[0]
