"""Sampling through the whole engine: seeds, n, stops, lengths, logprobs."""

from __future__ import annotations

import math
import random
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from engine import LLM, FinishReason, SamplingParams
from tests.fixtures.text_cases import model_that_ends_early, stop_string_spanning_tokens
from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy


@pytest.fixture(scope="module")
def llm(tiny_model: TinyModelFactory, async_scheduling: bool) -> LLM:
    return LLM(model=str(tiny_model("llama")), dtype="float32", block_size=4, async_scheduling=async_scheduling)


def prompts_of(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


def test_seeded_sampling_is_reproducible_across_batch_compositions(llm: LLM) -> None:
    target = prompts_of((7,), seed=1)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234, ignore_eos=True)
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([target], seeded)[0].outputs[0].token_ids
    others = prompts_of((3, 15, 8), seed=2)
    batch = [others[0], target, others[1], others[2]]
    params = [unseeded, seeded, unseeded, unseeded]
    mixed = llm.generate(batch, params)[1].outputs[0].token_ids
    reordered = llm.generate([target] + others, [seeded] + [unseeded] * 3)[0].outputs[0].token_ids
    assert alone == mixed == reordered
    different_seed = llm.generate([target], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12,
                                                           seed=99, ignore_eos=True))[0]
    assert different_seed.outputs[0].token_ids != alone


def test_n_samples_are_distinct_and_reproducible(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True)
    first = llm.generate(prompts_of((5,)), params)[0]
    again = llm.generate(prompts_of((5,)), params)[0]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    samples = [tuple(o.token_ids) for o in first.outputs]
    assert len(set(samples)) == 3
    assert samples == [tuple(o.token_ids) for o in again.outputs]


def test_n_greedy_samples_all_equal_the_greedy_continuation(llm: LLM, tiny_model: TinyModelFactory) -> None:
    prompt = prompts_of((6,))[0]
    out = llm.generate([prompt], SamplingParams(n=2, temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    expected = hf_greedy(tiny_model("llama"), [prompt], 5)[0]
    assert [o.token_ids for o in out.outputs] == [expected, expected]


def test_max_tokens_ends_with_length(llm: LLM) -> None:
    out = llm.generate(prompts_of((4,)), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3
    assert out.outputs[0].finish_reason == FinishReason.LENGTH


def test_stop_token_ids_end_generation_and_are_reported(llm: LLM, tiny_model: TinyModelFactory) -> None:
    prompt = prompts_of((6,), seed=5)[0]
    greedy = hf_greedy(tiny_model("llama"), [prompt], 8)[0]
    stop_id = greedy[3]
    first_at = greedy.index(stop_id)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop_id],
                                                ignore_eos=True))[0].outputs[0]
    assert out.token_ids == greedy[:first_at + 1]
    assert out.finish_reason == FinishReason.STOP and out.stop_reason == stop_id
    # the stop token's text is left out, as in vLLM
    assert out.text == llm.get_tokenizer().decode(out.token_ids[:-1], skip_special_tokens=True)


def test_min_tokens_defers_stop_token_ids(llm: LLM, tiny_model: TinyModelFactory) -> None:
    prompt = prompts_of((6,), seed=5)[0]
    greedy = hf_greedy(tiny_model("llama"), [prompt], 8)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8,
                                                stop_token_ids=[greedy[0]], ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 8
    assert greedy[0] not in out.token_ids  # suppressed while below min_tokens, not merely ignored


@pytest.mark.parametrize("include_stop_str_in_output", [False, True])
def test_a_stop_string_spanning_tokens_cuts_the_text_where_the_tokenizer_puts_it(
        llm: LLM, tiny_model: TinyModelFactory, include_stop_str_in_output: bool) -> None:
    prompt = prompts_of((6,), seed=8)[0]
    greedy = hf_greedy(tiny_model("llama"), [prompt], 12)[0]
    case = stop_string_spanning_tokens(AutoTokenizer.from_pretrained(tiny_model("llama")), greedy)
    params = SamplingParams(temperature=0.0, max_tokens=12, stop=[case.stop, "never there"], ignore_eos=True,
                            include_stop_str_in_output=include_stop_str_in_output)
    out = llm.generate([prompt], params)[0].outputs[0]
    assert out.text == case.text + (case.stop if include_stop_str_in_output else "")
    assert out.finish_reason == FinishReason.STOP and out.stop_reason == case.stop
    assert out.token_ids == greedy[: case.num_tokens]  # ends at the token that completes it


def test_min_tokens_defers_stop_strings(llm: LLM, tiny_model: TinyModelFactory) -> None:
    prompt = prompts_of((6,), seed=8)[0]
    greedy = hf_greedy(tiny_model("llama"), [prompt], 12)[0]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model("llama"))
    case = stop_string_spanning_tokens(tokenizer, greedy)
    full = tokenizer.decode(greedy, skip_special_tokens=True)
    assert full.count(case.stop) == 1, "pick a prompt whose stop string occurs once"
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=case.num_tokens, stop=case.stop,
                            ignore_eos=True)
    out = llm.generate([prompt], params)[0].outputs[0]
    assert out.text == full and out.finish_reason == FinishReason.LENGTH


EARLY_EOS_PROMPT = prompts_of((6,), seed=8)[0]
EOS_TOKEN_ID = 0  # <|endoftext|> in the tiny tokenizer


@pytest.fixture(scope="module")
def early_eos_model(tiny_model: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The llama tiny model made to reach EOS (a special token) after a few tokens of EARLY_EOS_PROMPT."""
    return model_that_ends_early(tiny_model("llama"), tmp_path_factory.mktemp("early-eos") / "model",
                                 EARLY_EOS_PROMPT, position=4, eos_token_id=EOS_TOKEN_ID)


@pytest.fixture(scope="module")
def early_eos_llm(early_eos_model: Path, async_scheduling: bool) -> LLM:
    return LLM(model=str(early_eos_model), dtype="float32", block_size=4, async_scheduling=async_scheduling)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("include_stop_str_in_output", [False, True])
def test_eos_text_is_left_out_unless_include_stop_str_in_output(
        early_eos_model: Path, early_eos_llm: LLM, skip_special_tokens: bool, include_stop_str_in_output: bool
) -> None:
    greedy = hf_greedy(early_eos_model, [EARLY_EOS_PROMPT], 12)[0]
    assert 2 <= greedy.index(EOS_TOKEN_ID) < 12, greedy
    expected_ids = greedy[: greedy.index(EOS_TOKEN_ID) + 1]
    shown = expected_ids if include_stop_str_in_output else expected_ids[:-1]
    expected = AutoTokenizer.from_pretrained(early_eos_model).decode(shown, skip_special_tokens=skip_special_tokens)
    out = early_eos_llm.generate([EARLY_EOS_PROMPT], SamplingParams(
        temperature=0.0, max_tokens=12, skip_special_tokens=skip_special_tokens,
        include_stop_str_in_output=include_stop_str_in_output))[0].outputs[0]
    assert out.token_ids == expected_ids and out.text == expected
    assert out.finish_reason == FinishReason.STOP and out.stop_reason is None


def test_eos_ends_generation_unless_ignored(tiny_model: TinyModelFactory, async_scheduling: bool,
                                           tmp_path: Path) -> None:
    source = tiny_model("llama")
    eos = next(iter(LLM(model=str(source), dtype="float32").engine.model_config.eos_token_ids))
    # a copy of the model whose EOS token is the overwhelming favourite: its lm_head row raised in the checkpoint
    # (a loaded CPU model holds its linear weights packed, out of reach)
    model_dir = tmp_path / "eos-favourite"
    shutil.copytree(source, model_dir)
    checkpoint = model_dir / "model.safetensors"
    tensors = load_file(checkpoint)
    tensors["lm_head.weight"][eos] *= 50
    save_file(tensors, checkpoint, metadata={"format": "pt"})
    llm = LLM(model=str(model_dir), dtype="float32", async_scheduling=async_scheduling)
    prompt = prompts_of((5,))[0]
    stopped = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6))[0].outputs[0]
    assert stopped.token_ids[-1] == eos and stopped.finish_reason == FinishReason.STOP
    ignored = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert len(ignored.outputs[0].token_ids) == 6


def test_logprobs_are_raw_model_logprobs_with_ranks(llm: LLM) -> None:
    prompt = prompts_of((5,))[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, logprobs=2,
                                                ignore_eos=True))[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 3
    for token_id, position in zip(out.token_ids, out.logprobs, strict=True):
        assert token_id in position and position[token_id].rank == 1  # greedy picks the top token
        assert len(position) == 2  # the sampled token is also the top-1
        assert all(lp.logprob <= 0 and lp.decoded_token is not None for lp in position.values())
    total = sum(p[t].logprob for t, p in zip(out.token_ids, out.logprobs, strict=True))
    assert out.cumulative_logprob is not None and math.isclose(out.cumulative_logprob, total, rel_tol=1e-6)


def test_context_limit_ends_with_length(tiny_model: TinyModelFactory, async_scheduling: bool) -> None:
    llm = LLM(model=str(tiny_model("llama")), dtype="float32", max_model_len=12, async_scheduling=async_scheduling)
    out = llm.generate([prompts_of((9,))[0]], SamplingParams(temperature=0.0, max_tokens=None,
                                                             ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == FinishReason.LENGTH


def _continued(llm: LLM, prompt: list[int], params: SamplingParams, output_token_ids: list[int]) -> list[int]:
    """The tokens an engine generates after `output_token_ids`, given as the request's output so far (a decode
    migration's continuation)."""
    engine = llm.engine
    engine.add_request("continued", prompt, params, output_token_ids=output_token_ids)
    token_ids = []
    while engine.has_unfinished():
        token_ids += [step.token_id for step in engine.step()]
    return token_ids


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
    # seeded noise of output token k depends on (seed, k); penalties count output tokens; min_tokens from the start
    SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, min_tokens=6, presence_penalty=0.5,
                   frequency_penalty=0.5, repetition_penalty=1.2),
], ids=["greedy", "seeded-with-penalties"])
def test_a_request_continued_from_its_output_so_far_generates_what_the_undisturbed_one_did(
        llm: LLM, params: SamplingParams) -> None:
    prompt = prompts_of((9,), seed=3)[0]
    undisturbed = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert len(undisturbed) == 10
    for k in (1, 4, 9):
        assert _continued(llm, prompt, params, undisturbed[:k]) == undisturbed[k:], f"continued after {k} tokens"


def test_a_continuation_must_leave_a_token_to_generate(llm: LLM) -> None:
    with pytest.raises(ValueError, match="nothing is left to generate"):
        llm.engine.make_request("c", [5, 6], SamplingParams(max_tokens=2), output_token_ids=[7, 8])
    with pytest.raises(ValueError, match="output token id"):
        llm.engine.make_request("c", [5, 6], SamplingParams(max_tokens=4), output_token_ids=[10**9])
