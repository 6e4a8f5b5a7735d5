"""Asynchronous scheduling (EngineConfig.async_scheduling): step N+1 is scheduled and launched before the host
reads step N's tokens. Greedy outputs against transformers; sampled ones against the synchronous engine, whose
own parity tests tie it to transformers; and the bookkeeping that makes it safe: pending tokens fed from the
device, stops a step late without emitting the extra token, no step past a length limit, blocks all returned."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import LLM, FinishReason, SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import RequestStatus
from engine.sampler import SampledToken
from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def prompts_of(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


def make_llm(model: Path, async_scheduling: bool, **options: object) -> LLM:
    return LLM(model=str(model), dtype="float32", block_size=4, async_scheduling=async_scheduling, **options)


@pytest.fixture(scope="module")
def model(tiny_model: TinyModelFactory) -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def engines(model: Path) -> Iterator[tuple[LLM, LLM]]:
    yield make_llm(model, False), make_llm(model, True)


def count_launches(engine: LLMEngine) -> list[int]:
    """Wraps the runner's execute to count launched steps; returns the counter ([n])."""
    launches = [0]
    execute = engine.runner.execute

    def counted(batch):  # type: ignore[no-untyped-def]
        launches[0] += 1
        return execute(batch)

    engine.runner.execute = counted  # type: ignore[method-assign]
    return launches


def test_async_is_off_on_cpu_unless_asked(model: Path) -> None:
    assert not LLMEngine(EngineConfig(model=str(model), dtype="float32")).async_scheduling
    assert LLMEngine(EngineConfig(model=str(model), dtype="float32", async_scheduling=True)).async_scheduling


def test_greedy_mixed_batch_with_chunked_prefill_matches_transformers(model: Path) -> None:
    llm = make_llm(model, True, max_num_batched_tokens=7)
    prompts = prompts_of((1, 3, 9, 17, 30))
    outputs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(model, prompts, GREEDY.max_tokens)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks and not llm.engine.requests


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, seed=11, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=5, max_tokens=9, min_tokens=6, logprobs=3, ignore_eos=True),
    # penalties need the output ids on the host: the engine reads each step before scheduling the next
    SamplingParams(temperature=1.0, seed=3, max_tokens=9, presence_penalty=0.5, frequency_penalty=0.4,
                   repetition_penalty=1.3, ignore_eos=True),
], ids=["seeded-top-p-k-min-p", "min-tokens-logprobs", "penalties"])
def test_sampled_outputs_equal_the_synchronous_engines(engines: tuple[LLM, LLM], params: SamplingParams) -> None:
    sync_llm, async_llm = engines
    prompts = prompts_of((4, 11, 6), seed=1)
    # a greedy neighbour in the batch: the random rows must not depend on it
    params_list = [params, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), params]
    expected = sync_llm.generate(prompts, params_list)
    got = async_llm.generate(prompts, params_list)
    for want, have in zip(expected, got, strict=True):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        assert have.outputs[0].finish_reason == want.outputs[0].finish_reason
        assert have.outputs[0].logprobs == want.outputs[0].logprobs


def test_the_next_step_runs_before_the_host_has_the_token_it_takes_as_input(model: Path) -> None:
    engine = make_llm(model, True).engine
    prompt = prompts_of((6,), seed=2)[0]
    request = engine.add_request("r", prompt, GREEDY)
    assert engine.step() == []  # the prefill launched; its token is read by the next call
    assert request.num_pending_tokens == 1 and request.token_ids == prompt
    expected = hf_greedy(model, [prompt], GREEDY.max_tokens)[0]
    outputs = engine.step()
    # the first decode step was launched with the first token still pending: its input came from the device
    assert [o.token_id for o in outputs] == expected[:1]
    assert request.num_pending_tokens == 1 and request.num_computed_tokens == len(prompt) + 1
    tokens = [o.token_id for o in outputs]
    while engine.has_unfinished():
        tokens += [o.token_id for o in engine.step()]
    assert tokens == expected and request.num_pending_tokens == 0


def test_a_stop_token_ends_the_request_a_step_late_without_emitting_the_extra_token(model: Path) -> None:
    llm = make_llm(model, True)
    prompt = prompts_of((6,), seed=5)[0]
    greedy = hf_greedy(model, [prompt], 8)[0]
    stop_id = greedy[3]
    first_at = greedy.index(stop_id)
    launches = count_launches(llm.engine)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop_id],
                                                ignore_eos=True))[0].outputs[0]
    assert out.token_ids == greedy[:first_at + 1]
    assert out.finish_reason == FinishReason.STOP and out.stop_reason == stop_id
    # the prefill, a decode per further token, and the one extra step whose token is discarded
    assert launches[0] == first_at + 2
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks and not llm.engine.requests


@pytest.mark.parametrize("limit", ["max_tokens", "context"])
def test_a_length_limit_is_not_stepped_past(model: Path, limit: str) -> None:
    llm = make_llm(model, True, max_model_len=12) if limit == "context" else make_llm(model, True)
    params = SamplingParams(temperature=0.0, max_tokens=3 if limit == "max_tokens" else None, ignore_eos=True)
    prompt = prompts_of((9,), seed=6)[0]
    launches = count_launches(llm.engine)
    out = llm.generate([prompt], params)[0].outputs[0]
    assert out.token_ids == hf_greedy(model, [prompt], 3)[0] and out.finish_reason == FinishReason.LENGTH
    assert launches[0] == 3  # the limit is known without the last token: no extra step
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_an_abort_between_steps_drops_the_in_flight_token_and_the_rest_runs_on(model: Path) -> None:
    engine = make_llm(model, True).engine
    prompts = prompts_of((5, 7), seed=7)
    engine.add_request("kept", prompts[0], GREEDY)
    engine.add_request("aborted", prompts[1], GREEDY)
    tokens: dict[str, list[int]] = {"kept": [], "aborted": []}
    for _ in range(3):
        for out in engine.step():
            tokens[out.request_id].append(out.token_id)
    assert engine.abort("aborted")  # its next token is being computed
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].append(out.token_id)
    expected = hf_greedy(model, prompts, GREEDY.max_tokens)
    assert tokens["kept"] == expected[0]
    assert tokens["aborted"] == expected[1][:2]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and not engine.requests


def test_preemption_while_a_token_is_pending_keeps_the_token(model: Path) -> None:
    # 10 blocks of 4 tokens: three 9-token prompts + 8 outputs each cannot all fit at once
    llm = make_llm(model, True, num_kv_blocks=10)
    scheduler = llm.engine.scheduler
    preempt = scheduler._preempt
    pending_when_preempted = []

    def recording(request):  # type: ignore[no-untyped-def]
        pending_when_preempted.append(request.num_pending_tokens)
        preempt(request)

    scheduler._preempt = recording  # type: ignore[method-assign]
    prompts = prompts_of((9, 9, 9), seed=3)
    outputs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(model, prompts, GREEDY.max_tokens)
    assert any(pending_when_preempted), "no request was preempted with a token in flight"
    assert llm.engine.kv.num_free_blocks == 10


def test_prefix_blocks_are_cached_only_once_their_step_is_read(model: Path) -> None:
    llm = make_llm(model, True)
    shared = prompts_of((18,), seed=8)[0]
    prompts = [shared + tail for tail in prompts_of((1, 5), seed=9)]
    llm.generate(prompts[:1], GREEDY)
    second = llm.generate(prompts, GREEDY)
    assert [o.num_cached_tokens for o in second] == [16, 16]
    assert [o.outputs[0].token_ids for o in second] == hf_greedy(model, prompts, GREEDY.max_tokens)


def test_pinned_prefill_then_remote_kv_admission_both_asynchronous(model: Path) -> None:
    """A prefill node's engine pins the prompt after its first token; a decode node's admits it with the K/V."""
    prefill, decode = make_llm(model, True).engine, make_llm(model, True).engine
    prompt = prompts_of((11,), seed=4)[0]
    request = prefill.add_request("p", prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                                  pin_blocks=True)
    launches = count_launches(prefill)
    outputs = []
    while prefill.has_unfinished():
        outputs += prefill.step()
    assert launches[0] == 1 and [o.finish_reason for o in outputs] == [FinishReason.LENGTH]
    assert request.status is RequestStatus.FINISHED_PINNED
    pinned = prefill.pinned_blocks("p")
    assert pinned is not None

    # a request still running on the decode engine while the other one is admitted between its steps
    other_prompt = prompts_of((5,), seed=10)[0]
    decode.add_request("other", other_prompt, GREEDY)
    other_tokens = [o.token_id for o in decode.step() + decode.step()]
    incoming = decode.make_request("d", prompt, GREEDY)
    reserved = decode.reserve_remote_kv(incoming)
    assert reserved is not None
    decode.kv_cache[reserved.block_ids] = prefill.kv_cache[list(pinned.block_ids)]
    assert prefill.free_pinned("p")
    assert not decode.admit_remote_kv("d", SampledToken(request.token_ids[-1])).finished
    while decode.has_unfinished():
        other_tokens += [o.token_id for o in decode.step() if o.request_id == "other"]
    expected = hf_greedy(model, [prompt, other_prompt], GREEDY.max_tokens)
    assert incoming.output_token_ids == expected[0] and other_tokens == expected[1]
    assert decode.kv.num_free_blocks == decode.kv.num_blocks and not decode.requests


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=8, min_tokens=6, ignore_eos=True),
], ids=["greedy", "seeded-min-tokens"])
def test_a_migrated_continuation_generates_what_the_undisturbed_request_did(
        engines: tuple[LLM, LLM], params: SamplingParams) -> None:
    sync_llm, async_llm = engines
    prompt = prompts_of((9,), seed=3)[0]
    undisturbed = sync_llm.generate([prompt], params)[0].outputs[0].token_ids
    engine = async_llm.engine
    engine.add_request("continued", prompt, params, output_token_ids=undisturbed[:3])
    continued = []
    while engine.has_unfinished():
        continued += [o.token_id for o in engine.step()]
    assert continued == undisturbed[3:]
