"""logit_bias (OpenAI's, as vLLM v1 applies it): validated at the edge (SamplingParams, the engine for the
vocabulary), added to the logits after the grammar's mask and before the penalties, at every sampled position
(greedy, a prefill node's first token, decode steps, speculative verification), with the logprobs left the
model's own; checked against transformers' logits with the bias added by hand."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampler import Sampler, SamplingRow, TokenBitmask, process_logits
from engine.structured_output import bitmask_width
from engine.types import logit_bias_from_json
from prefill_node.loop import PrefillError, PrefillLoop
from tests.fixtures.handoff import handed_off_tokens
from tests.fixtures.tiny_models import TinyModelFactory, _load_oracle

PROMPT = [17, 250, 33, 981, 402, 5]
MAX_TOKENS = 6


def row(params: SamplingParams) -> SamplingRow:
    return SamplingRow(params, None if params.greedy else 0, [], [])


def hf_biased_greedy(model: Path, prompt: list[int], logit_bias: dict[int, float], max_tokens: int) -> list[int]:
    """The oracle: transformers' float32 logits of the whole sequence each step, the bias added, argmax."""
    hf = _load_oracle(str(model.resolve()))
    token_ids = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = hf(torch.tensor([token_ids])).logits[0, -1].float()
            for token_id, bias in logit_bias.items():
                logits[token_id] += bias
            token_ids.append(int(logits.argmax()))
    return token_ids[len(prompt):]


def hf_first_logits(model: Path, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return _load_oracle(str(model.resolve()))(torch.tensor([prompt])).logits[0, -1].float()


# ---- validation ----
@pytest.mark.parametrize("logit_bias, match", [
    ({5: 100.5}, r"logit_bias of token 5 must be a number in \[-100, 100\]"),
    ({5: -101}, r"logit_bias of token 5"),
    ({5: math.nan}, r"logit_bias of token 5"),
    ({5: math.inf}, r"logit_bias of token 5"),
    ({5: True}, r"logit_bias of token 5"),
    ({5: "1"}, r"logit_bias of token 5"),
    ({-1: 1.0}, r"logit_bias token ids must be non-negative integers"),
    ({True: 1.0}, r"logit_bias token ids"),
    ({"5": 1.0}, r"logit_bias token ids"),
    ([(5, 1.0)], r"logit_bias must map token ids to biases"),
])
def test_bad_logit_bias_is_a_value_error_naming_it(logit_bias: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(logit_bias=logit_bias)  # type: ignore[arg-type]


def test_logit_bias_is_kept_as_float_biases_and_an_empty_one_as_none() -> None:
    params = SamplingParams(logit_bias={5: 100, 7: -100, 9: 0.5})
    assert params.logit_bias == {5: 100.0, 7: -100.0, 9: 0.5}
    assert all(type(bias) is float for bias in params.logit_bias.values())
    assert SamplingParams(logit_bias={}).logit_bias is None


def test_json_logit_bias_keys_are_decimal_token_ids() -> None:
    assert logit_bias_from_json({"5": 1, "12": -2.5}) == {5: 1, 12: -2.5}
    assert logit_bias_from_json(None) is None
    for key in ("-1", "1.5", " 1", "1_0", "x", "", "١"):
        with pytest.raises(ValueError, match="logit_bias keys must be token ids"):
            logit_bias_from_json({key: 1})
    with pytest.raises(ValueError, match="logit_bias must be an object"):
        logit_bias_from_json([1, 2])


# ---- the sampler ----
def test_the_bias_is_added_to_its_rows_logits_only() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    processed = process_logits(logits, [row(SamplingParams(temperature=0.0, logit_bias={3: 2.5, 7: -1.0})),
                                        row(SamplingParams(temperature=0.0)),
                                        row(SamplingParams(temperature=0.0, logit_bias={3: -4.0}))])
    expected = logits.clone()
    expected[0, 3] += 2.5
    expected[0, 7] -= 1.0
    expected[2, 3] -= 4.0
    assert torch.equal(processed, expected)


def test_a_bias_of_100_wins_greedy_and_random_rows_and_logprobs_stay_the_models() -> None:
    logits = torch.randn(2, 200, generator=torch.Generator().manual_seed(1)) * 3
    target = int(logits[0].argmin())
    rows = [row(SamplingParams(temperature=0.0, logprobs=1, logit_bias={target: 100})),
            row(SamplingParams(temperature=1.0, seed=3, logprobs=1, logit_bias={target: 100}))]
    tokens = Sampler()(logits, rows)
    assert [token.token_id for token in tokens] == [target, target]
    raw = logits.log_softmax(dim=-1)
    for i, token in enumerate(tokens):
        assert token.logprobs is not None
        assert token.logprobs[target].logprob == pytest.approx(float(raw[i, target]), abs=1e-5)
        assert token.logprobs[target].rank == int((raw[i] > raw[i, target]).sum()) + 1  # the raw rank, not 1


def test_a_bias_never_revives_a_token_the_grammar_refuses() -> None:
    logits = torch.zeros(1, 64)
    bitmask = torch.zeros(1, bitmask_width(64), dtype=torch.int32)
    bitmask[0, 0] = 0b110  # tokens 1 and 2 allowed
    params = SamplingParams(temperature=0.0, logit_bias={5: 100, 2: 1})
    out = Sampler().sample(logits, [row(params)], TokenBitmask([0], bitmask))
    assert out.token_ids.tolist() == [2]


def test_the_bias_applies_before_the_repetition_penalty_as_in_vllm_v1() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 4] = 2.0
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={4: 2.0})
    processed = process_logits(logits, [SamplingRow(params, None, [4], [])])
    assert float(processed[0, 4]) == pytest.approx((2.0 + 2.0) / 2.0)  # (2 / 2) + 2 = 3 if the other way round


# ---- the engine against transformers ----
@pytest.fixture(scope="module")
def model(tiny_model: TinyModelFactory) -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def llm(model: Path, async_scheduling: bool) -> LLM:
    return LLM(model=str(model), dtype="float32", block_size=4, async_scheduling=async_scheduling)


def test_a_bias_of_100_makes_greedy_decoding_write_the_token_every_step(llm: LLM, model: Path) -> None:
    target = int(hf_first_logits(model, PROMPT).argmin())  # the model's least likely first token
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias={target: 100})
    assert llm.generate([PROMPT], params)[0].outputs[0].token_ids == [target] * MAX_TOKENS


def test_a_bias_of_minus_100_on_the_greedy_token_picks_transformers_second_best(llm: LLM, model: Path) -> None:
    second, best = hf_first_logits(model, PROMPT).topk(2).indices.tolist()[::-1]
    logit_bias = {best: -100.0}
    expected = hf_biased_greedy(model, PROMPT, logit_bias, MAX_TOKENS)
    assert expected[0] == second
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias=logit_bias)
    assert llm.generate([PROMPT], params)[0].outputs[0].token_ids == expected


def test_a_token_id_past_the_vocabulary_is_refused_by_the_engine(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"logit_bias token id 1000 is outside the vocabulary \[0, 1000\)"):
        llm.generate([PROMPT], SamplingParams(logit_bias={3: 1.0, 1000: 1.0}))
    assert not llm.engine.has_unfinished()


def test_speculative_verification_applies_the_bias_at_every_drafted_position(model: Path) -> None:
    spec = LLM(model=str(model), dtype="float32", block_size=4,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                                   "prompt_lookup_min": 1})
    target = int(hf_first_logits(model, PROMPT).argmin())
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logit_bias={target: 100})
    assert spec.generate([PROMPT], params)[0].outputs[0].token_ids == [target] * 16
    stats = spec.engine.stats()  # the repeated token makes n-gram drafts of itself: they were verified and kept
    assert stats.spec_decode_num_accepted_tokens > 0
    other = {int(hf_first_logits(model, PROMPT).argmax()): -100.0}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias=other)
    assert spec.generate([PROMPT], params)[0].outputs[0].token_ids == hf_biased_greedy(model, PROMPT, other,
                                                                                        MAX_TOKENS)


def test_a_request_handed_from_a_prefill_engine_keeps_its_bias_on_both_sides(model: Path) -> None:
    config = EngineConfig(model=str(model), dtype="float32", block_size=4, async_scheduling=False)
    prefill, decode = LLMEngine(config), LLMEngine(config)
    logit_bias = {int(hf_first_logits(model, PROMPT).argmax()): -100.0}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias=logit_bias)
    assert handed_off_tokens(prefill, decode, "r", PROMPT, params) == hf_biased_greedy(model, PROMPT, logit_bias,
                                                                                      MAX_TOKENS)


# ---- the prefill node: its first token, and its INVALID_ARGUMENT ----
@pytest.fixture
def prefill_loop(model: Path) -> Iterator[PrefillLoop]:
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(model), dtype="float32", block_size=4, num_kv_blocks=32,
                                                skip_tokenizer_init=True, async_scheduling=False)))
    # the ticket is the pinned blocks themselves: what a ticket describes, without a transfer endpoint
    loop = PrefillLoop(engine, "p0", 30.0, lambda ticket_id, pinned, deadline: pinned)  # type: ignore[arg-type,return-value]
    engine.start()
    yield loop
    engine.stop()


def test_the_prefill_node_samples_its_first_token_with_the_bias(prefill_loop: PrefillLoop, model: Path) -> None:
    target = int(hf_first_logits(model, PROMPT).argmin())

    async def run() -> None:
        params = SamplingParams(temperature=0.0, max_tokens=4, logit_bias={target: 100})
        result = await prefill_loop.prefill("r", PROMPT, params, deadline=None)
        assert result.first.token_id == target
        with pytest.raises(PrefillError, match="logit_bias token id 5000") as error:
            await prefill_loop.prefill("bad", PROMPT, SamplingParams(logit_bias={5000: 1.0}), deadline=None)
        assert error.value.code == "INVALID_ARGUMENT"

    asyncio.run(run())
