"""Prompt logprobs (SamplingParams.prompt_logprobs) equal transformers' float32 log-softmax at every prompt position,
with ranks and the top-N: one prefill, a chunked one, a prefix the cache holds, preemption, two tensor-parallel
ranks; and a prompt whose K/V comes from elsewhere computes none."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine import prompt_logprobs as prompt_logprobs_module
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampler import SampledToken
from engine.types import PromptLogprobs
from node_common.limits import check_limits
from tests.fixtures.tiny_models import TinyModelFactory, _load_oracle, hf_greedy

TOLERANCE = 1e-4


def random_prompts(vocab_size: int, lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def oracle_logprobs(model: Path, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each prompt position, [len(prompt), vocab]: row p predicts token p + 1."""
    with torch.inference_mode():
        logits = _load_oracle(str(model.resolve()))(torch.tensor([prompt])).logits[0]
    return logits.to(torch.float32).log_softmax(dim=-1)


def assert_match_oracle(prompt_logprobs: PromptLogprobs | None, prompt: list[int], oracle: torch.Tensor,
                        num_top: int) -> None:
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for p in range(1, len(prompt)):
        position, row, token_id = prompt_logprobs[p], oracle[p - 1], prompt[p]
        assert position is not None
        # the prompt token and the top-N, nothing else (the prompt token once, when it is among them)
        assert set(position) == {token_id, *row.topk(num_top).indices.tolist()}, f"position {p}"
        for entry_id, entry in position.items():
            expected = row[entry_id].item()
            assert abs(entry.logprob - expected) < TOLERANCE, f"position {p}, token {entry_id}"
            # 1 + the tokens with a greater logprob, give or take the ones within the tolerance of it
            assert (int((row > expected + TOLERANCE).sum()) + 1 <= entry.rank
                    <= int((row > expected - TOLERANCE).sum()) + 1), f"position {p}, token {entry_id}"


def test_prompt_logprobs_equal_transformers_with_ranks_and_top_n(tiny_model: TinyModelFactory,
                                                                async_scheduling: bool) -> None:
    model = tiny_model("llama")
    llm = LLM(model=str(model), dtype="float32", block_size=4, async_scheduling=async_scheduling)
    prompts = random_prompts(llm.engine.model_config.vocab_size, (1, 6, 17, 9))
    params = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=n) for n in (3, 3, 5)]
    plain = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outputs = llm.generate(prompts, [*params, plain])
    for output, prompt, p in zip(outputs[:3], prompts, params, strict=False):
        assert p.prompt_logprobs is not None
        assert_match_oracle(output.prompt_logprobs, prompt, oracle_logprobs(model, prompt), p.prompt_logprobs)
        assert all(entry.decoded_token is not None for position in output.prompt_logprobs or [] if position
                   for entry in position.values())
    assert outputs[3].prompt_logprobs is None
    # computing them changes nothing about what is generated
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(model, prompts, 3)


def test_prompt_logprobs_of_zero_hold_the_prompt_token_alone(tiny_model: TinyModelFactory) -> None:
    model = tiny_model("llama")
    llm = LLM(model=str(model), dtype="float32", block_size=4)
    prompt = random_prompts(llm.engine.model_config.vocab_size, (7,), seed=1)[0]
    # n=2: the prompt's logprobs are the request's, once
    output = llm.generate([prompt], SamplingParams(max_tokens=2, n=2, seed=3, prompt_logprobs=0))[0]
    assert output.prompt_logprobs is not None
    assert [list(position) if position else None for position in output.prompt_logprobs] == [
        None, *([token_id] for token_id in prompt[1:])]
    assert_match_oracle(output.prompt_logprobs, prompt, oracle_logprobs(model, prompt), 0)


@pytest.mark.parametrize("budget", [3, 5])
def test_a_chunked_prefill_gives_the_logprobs_of_every_chunk(tiny_model: TinyModelFactory, budget: int,
                                                             async_scheduling: bool) -> None:
    model = tiny_model("qwen3")
    llm = LLM(model=str(model), dtype="float32", block_size=4, max_num_batched_tokens=budget,
              async_scheduling=async_scheduling)
    prompts = random_prompts(llm.engine.model_config.vocab_size, (13, 2, 8), seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    outputs = llm.generate(prompts, params)
    for output, prompt in zip(outputs, prompts, strict=True):
        assert_match_oracle(output.prompt_logprobs, prompt, oracle_logprobs(model, prompt), 2)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(model, prompts, 4)


def test_long_chunks_take_their_logits_a_slice_of_rows_at_a_time(tiny_model: TinyModelFactory,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("llama")
    llm = LLM(model=str(model), dtype="float32", block_size=4)
    vocab = llm.engine.model_config.vocab_size
    monkeypatch.setattr(prompt_logprobs_module, "_SLICE_BYTES", 3 * 4 * vocab)  # 3 rows of float32 logprobs a slice
    assert [(s.start, s.stop) for s in prompt_logprobs_module.logits_slices(7, vocab)] == [(0, 3), (3, 6), (6, 7)]
    prompt = random_prompts(vocab, (12,), seed=8)[0]
    output = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert_match_oracle(output.prompt_logprobs, prompt, oracle_logprobs(model, prompt), 2)


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(tiny_model: TinyModelFactory,
                                                                async_scheduling: bool) -> None:
    model = tiny_model("llama")
    llm = LLM(model=str(model), dtype="float32", block_size=4, async_scheduling=async_scheduling)
    shared, tail = random_prompts(llm.engine.model_config.vocab_size, (16, 5), seed=3)
    plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([shared + [7]], plain)  # caches the 16-token prefix
    prompt = shared + tail
    output = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True,
                                                   prompt_logprobs=1))[0]
    # cached positions have no logits: the request took no hit, and every position is the oracle's
    assert output.num_cached_tokens == 0
    assert_match_oracle(output.prompt_logprobs, prompt, oracle_logprobs(model, prompt), 1)
    # the cache still serves the requests that do not ask
    assert llm.generate([prompt], plain)[0].num_cached_tokens == 20


def test_preempted_requests_still_get_each_prompt_position_once(tiny_model: TinyModelFactory,
                                                               async_scheduling: bool) -> None:
    model = tiny_model("qwen2")
    # 12 blocks of 4 tokens, prefilled 6 tokens a step: four 9-token prompts + 10 outputs cannot all fit at once
    llm = LLM(model=str(model), dtype="float32", block_size=4, num_kv_blocks=12, max_num_batched_tokens=6,
              async_scheduling=async_scheduling)
    prompts = random_prompts(llm.engine.model_config.vocab_size, (9, 9, 9, 9), seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, prompt_logprobs=2)
    outputs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for output, prompt in zip(outputs, prompts, strict=True):
        assert_match_oracle(output.prompt_logprobs, prompt, oracle_logprobs(model, prompt), 2)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(model, prompts, 10)
    assert llm.engine.kv.num_free_blocks == 12


def test_two_tensor_parallel_ranks_give_the_same_prompt_logprobs(tiny_model: TinyModelFactory) -> None:
    model = tiny_model("qwen3")
    llm = LLM(model=str(model), dtype="float32", block_size=4, max_num_batched_tokens=5, tensor_parallel_size=2)
    try:
        prompts = random_prompts(llm.engine.model_config.vocab_size, (11, 4), seed=5)
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                                       prompt_logprobs=2))
        for output, prompt in zip(outputs, prompts, strict=True):
            assert_match_oracle(output.prompt_logprobs, prompt, oracle_logprobs(model, prompt), 2)
    finally:
        llm.close()


def test_a_prompt_whose_kv_comes_from_elsewhere_computes_no_prompt_logprobs(tiny_model: TinyModelFactory) -> None:
    """A decode node's request: its prompt logprobs come from the node that prefilled it."""
    model = tiny_model("llama")
    engine = LLMEngine(EngineConfig(model=str(model), dtype="float32", block_size=4))
    prompt = random_prompts(engine.model_config.vocab_size, (9,), seed=6)[0]
    request = engine.make_request("d", prompt, SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2))
    assert engine.reserve_remote_kv(request) is not None
    first = engine.admit_remote_kv("d", SampledToken(5))
    outputs = [first]
    while engine.has_unfinished():
        outputs += engine.step()
    assert len(outputs) == 3 and all(output.prompt_logprobs is None for output in outputs)


def test_prompt_logprobs_are_bounded_like_logprobs() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs must be an integer >= 0"):
        SamplingParams(prompt_logprobs=-1)
    check_limits(SamplingParams(prompt_logprobs=20), max_logprobs=20)
    with pytest.raises(ValueError, match=r"prompt_logprobs must be at most 20 \(this node's --max-logprobs\)"):
        check_limits(SamplingParams(prompt_logprobs=21), max_logprobs=20)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_prompt_logprobs_equal_transformers_beside_graph_decodes(tiny_model: TinyModelFactory) -> None:
    """On a GPU (CUDA graphs, asynchronous scheduling, host copies that do not block): a plain request decodes while
    two others prefill in chunks with their prompt logprobs."""
    model = tiny_model("llama")
    llm = LLM(model=str(model), dtype="float32", block_size=16, max_num_batched_tokens=32, max_num_seqs=8)
    assert llm.engine.async_scheduling and llm.engine.runner.graphs is not None
    prompts = random_prompts(llm.engine.model_config.vocab_size, (6, 70, 40), seed=7)
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    params = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=n) for n in (3, 0)]
    outputs = llm.generate(prompts, [plain, *params])
    for output, prompt, p in zip(outputs[1:], prompts[1:], params, strict=True):
        assert p.prompt_logprobs is not None
        assert_match_oracle(output.prompt_logprobs, prompt, oracle_logprobs(model, prompt), p.prompt_logprobs)
    assert outputs[0].prompt_logprobs is None
