"""N-gram speculative decoding in the engine: greedy tokens equal transformers' (float32) and the non-speculative
engine's while drafts are accepted and rejected, logprobs equal transformers' at every position, and EOS-like stops,
max_tokens, stop strings, penalties and the prefix cache stay right when one step appends several tokens."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import LLM, FinishReason, SamplingParams
from engine.llm_engine import EngineStats
from tests.fixtures.spec_models import echo_prone_model
from tests.fixtures.tiny_models import TinyModelFactory, _load_oracle, hf_greedy

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def model(tiny_model: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return echo_prone_model(tiny_model("llama"), tmp_path_factory.mktemp("spec") / "echo")


@pytest.fixture(scope="module")
def prompts(model: Path) -> list[list[int]]:
    """Repetitive prompts: a random head, the oracle's greedy continuation of it, and the head again, so the model
    follows the earlier run for a while (drafts accepted) and then leaves it (drafts rejected)."""
    rng = random.Random(0)
    heads = [[rng.randrange(3, 900) for _ in range(8)] for _ in range(3)]
    walks = hf_greedy(model, heads, 30)
    return [head + walk + head for head, walk in zip(heads, walks, strict=True)]


@pytest.fixture(scope="module")
def greedy(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(model, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def spec_llm(model: Path) -> LLM:
    return LLM(model=str(model), dtype="float32", block_size=4, speculative_config=SPEC)


@pytest.fixture(scope="module")
def plain_llm(model: Path) -> LLM:
    return LLM(model=str(model), dtype="float32", block_size=4)


def spec_counts(llm: LLM) -> tuple[int, int, int]:
    stats: EngineStats = llm.engine.stats()
    return stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens


def test_greedy_tokens_equal_transformers_while_drafts_are_accepted_and_rejected(
        spec_llm: LLM, plain_llm: LLM, prompts: list[list[int]], greedy: list[list[int]]) -> None:
    before = spec_counts(spec_llm)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params)]
    drafts, draft_tokens, accepted = (after - b for after, b in zip(spec_counts(spec_llm), before, strict=True))
    assert ours == greedy
    assert [o.outputs[0].token_ids for o in plain_llm.generate(prompts, params)] == greedy
    assert drafts > 0 and 0 < accepted < draft_tokens, "both accepted and rejected drafts must be exercised"
    # fewer steps than tokens: accepted drafts are tokens no step of their own produced
    assert spec_llm.engine.kv.num_free_blocks == spec_llm.engine.kv.num_blocks, "every block back in the pool"


def test_logprobs_equal_transformers_at_every_position(model: Path, spec_llm: LLM, prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    outputs = [o.outputs[0] for o in spec_llm.generate(prompts, params)]
    oracle = _load_oracle(str(model.resolve()))  # hf_greedy's float32 transformers model, loaded once
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.logprobs is not None and len(out.logprobs) == MAX_TOKENS
        with torch.inference_mode():  # one forward over prompt + output: every position's distribution
            logits = oracle(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1]
        expected = logits.log_softmax(dim=-1)
        for position, (token_id, logprobs) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            top = expected[position].topk(3)
            assert set(logprobs) == {token_id, *top.indices.tolist()}
            for candidate, value in logprobs.items():
                assert value.logprob == pytest.approx(expected[position, candidate].item(), abs=1e-4)


@pytest.mark.parametrize("cut", [3, 9, 17, 26])
def test_a_stop_token_or_max_tokens_inside_accepted_drafts_ends_the_output_there(
        spec_llm: LLM, prompts: list[list[int]], greedy: list[list[int]], cut: int) -> None:
    expected = greedy[0][:cut + 1]
    stop_token = expected[-1]
    first = expected.index(stop_token)  # the stop token may occur earlier: the output ends at its first occurrence
    stopped = spec_llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                             stop_token_ids=[stop_token]))[0].outputs[0]
    assert stopped.token_ids == expected[:first + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == (FinishReason.STOP, stop_token)
    limited = spec_llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=cut + 1,
                                                             ignore_eos=True))[0].outputs[0]
    assert limited.token_ids == expected and limited.finish_reason == FinishReason.LENGTH


def test_a_stop_string_completed_by_an_accepted_draft_cuts_the_text_as_without_speculation(
        spec_llm: LLM, plain_llm: LLM, prompts: list[list[int]], greedy: list[list[int]]) -> None:
    tokenizer = spec_llm.get_tokenizer()
    full_text = tokenizer.decode(greedy[0], skip_special_tokens=True)
    # three characters from the middle of the output (none of them half of a split character)
    start = next(i for i in range(len(full_text) // 2, len(full_text) - 3)
                 if "\ufffd" not in full_text[i:i + 3] and full_text[i:i + 3].strip())
    stop = full_text[start:start + 3]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop])
    ours = spec_llm.generate([prompts[0]], params)[0].outputs[0]
    theirs = plain_llm.generate([prompts[0]], params)[0].outputs[0]
    assert ours.text == full_text[:full_text.index(stop)] == theirs.text
    assert (ours.finish_reason, ours.stop_reason) == (FinishReason.STOP, stop)
    assert ours.token_ids == theirs.token_ids


def test_penalties_and_min_tokens_see_the_drafts_before_each_position(
        spec_llm: LLM, plain_llm: LLM, prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.2, frequency_penalty=0.3,
                            min_tokens=5, stop_token_ids=[prompts[0][-1]])
    ours = [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params)]
    assert ours == [o.outputs[0].token_ids for o in plain_llm.generate(prompts, params)]


def test_blocks_written_by_verification_steps_serve_later_prefix_hits(
        model: Path, spec_llm: LLM, prompts: list[list[int]], greedy: list[list[int]]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    spec_llm.generate([prompts[1]], params)
    follow_up = prompts[1] + greedy[1][:32]  # the accepted drafts' blocks are cached under these tokens
    out = spec_llm.generate([follow_up], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert out.num_cached_tokens >= len(prompts[1]) + 28  # whole blocks of the output, not only the prompt's
    assert out.outputs[0].token_ids == hf_greedy(model, [follow_up], 8)[0]


def test_seeded_sampling_gives_the_tokens_it_gives_without_speculation(
        spec_llm: LLM, plain_llm: LLM, prompts: list[list[int]]) -> None:
    """Each position is sampled with the noise of its token index (engine/spec_decode/verify.py), so a seeded request
    reproduces the non-speculative one exactly: accepted drafts are the tokens it would have sampled."""
    before = spec_counts(spec_llm)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=MAX_TOKENS, ignore_eos=True, seed=7, n=3)
    ours = [[c.token_ids for c in o.outputs] for o in spec_llm.generate(prompts, params)]
    assert ours == [[c.token_ids for c in o.outputs] for o in plain_llm.generate(prompts, params)]
    assert spec_counts(spec_llm)[2] > before[2]
