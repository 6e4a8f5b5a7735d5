"""The proxy's OpenAI layer without a cluster: request validation, choice fan-out, the response formats, and
how the choices of one request share their fate (one error or a disconnect closes them all)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import grpc
import pytest

from engine.types import FinishReason, Logprob, SamplingParams
from proxy.api.app import create_app
from proxy.api.errors import APIError
from proxy.api.openai_api import parse_chat, parse_completion
from proxy.api.responses import ChatFormat, ChoiceDelta, CompletionFormat, Header, TokenLogprob, UsageTally
from proxy.api.serving import ProxyState, api_error, fan_out, generate
from proxy.routing.clients import NodeError
from proxy.routing.directory import NodeDirectory
from proxy.routing.pd import PDPipeline, TokenChunk
from proxy.routing.router import Router

MESSAGES = [{"role": "user", "content": "hi"}]


def test_completion_defaults_follow_openai() -> None:
    parsed = parse_completion({"prompt": "hello"})
    params = parsed.generation.params
    assert parsed.prompts == ["hello"] and params.max_tokens == 16 and params.n == 1 and params.logprobs is None
    assert params.temperature == 1.0 and not parsed.generation.stream and not parsed.generation.include_usage


def test_completion_prompts_may_be_token_ids_or_batches() -> None:
    assert parse_completion({"prompt": [1, 2, 3]}).prompts == [[1, 2, 3]]
    assert parse_completion({"prompt": ["a", "b"]}).prompts == ["a", "b"]
    assert parse_completion({"prompt": [[1], [2, 3]]}).prompts == [[1], [2, 3]]


def test_vllm_extras_and_float_integers_are_accepted() -> None:
    params = parse_completion({"prompt": "x", "max_tokens": 8.0, "top_k": 5, "min_p": 0.1, "min_tokens": 2,
                               "ignore_eos": True, "repetition_penalty": 1.2, "stop_token_ids": [7],
                               "response_format": {"type": "text"}}).generation.params
    assert (params.max_tokens, params.top_k, params.min_p, params.min_tokens) == (8, 5, 0.1, 2)
    assert params.ignore_eos and params.repetition_penalty == 1.2 and params.stop_token_ids == [7]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "temperature": math.nan}, "temperature"),
    ({"prompt": "x", "seed": 2**70}, "seed"),
    ({"prompt": "x", "max_tokens": 2**40}, "max_tokens"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ({"prompt": "x", "logit_bias": {"one": 5}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"1": 500}}, "logit_bias"),
    ({"prompt": "x", "echo": 1}, "echo"),
    ({"prompt": "x", "suffix": "after"}, "suffix"),
    ({"prompt": "x", "stream_options_typo": True}, "stream_options_typo"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    # found while writing proxy/api/openapi.py: a number of 400 digits (no float holds it) was a 500, and falsy
    # values of the wrong type (0, {}) slipped past the parameters we refuse
    ({"prompt": "x", "temperature": 10**400}, "temperature"),
    ({"prompt": "x", "suffix": 0}, "suffix"),
    ({"prompt": "x", "logit_bias": 0}, "logit_bias"),
    ({"prompt": [1, 2.5]}, "prompt"),
])
def test_bad_or_unsupported_completion_fields_are_refused_by_name(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as e:
        parse_completion(body)
    assert e.value.status == 400 and e.value.param == param


def test_chat_takes_max_completion_tokens_over_max_tokens_and_logprobs_as_a_flag() -> None:
    parsed = parse_chat({"messages": MESSAGES, "max_tokens": 5, "max_completion_tokens": 9, "logprobs": True})
    assert parsed.generation.params.max_tokens == 9 and parsed.generation.params.logprobs == 0
    assert parse_chat({"messages": MESSAGES, "logprobs": True, "top_logprobs": 3}).generation.params.logprobs == 3
    assert parse_chat({"messages": MESSAGES}).generation.params.max_tokens is None  # up to the context


@pytest.mark.parametrize("body, param", [
    ({"messages": MESSAGES, "max_completion_tokens": 3, "max_tokens": "many"}, "max_tokens"),  # was never read
    ({"messages": MESSAGES, "tools": {}}, "tools"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": 0}]}, "messages"),
    ({"messages": [{"role": "assistant", "content": "x", "function_call": [1]}]}, "messages"),
])
def test_bad_chat_fields_are_refused_by_name(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as e:
        parse_chat(body)
    assert e.value.status == 400 and e.value.param == param


def test_token_ids_may_be_whole_floats_as_json_schema_integers_are() -> None:
    """Found by schemathesis (tests/integration/test_fuzz_openapi.py): JSON Schema's integer 843.0 was refused."""
    assert parse_completion({"prompt": [293, 843.0]}).prompts == [[293, 843]]
    assert parse_completion({"prompt": "x", "stop_token_ids": [7.0]}).generation.params.stop_token_ids == [7]
    assert parse_chat({"messages": [{"role": "assistant", "content": None, "tool_calls": []}]}).messages


def test_chat_text_parts_are_joined_and_the_generation_prompt_is_on_by_default() -> None:
    parsed = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}]}]})
    assert parsed.messages[0].content == "ab" and parsed.add_generation_prompt


def test_choices_fan_out_prompt_major_with_seeds_spread() -> None:
    subs = fan_out([[1], [2]], SamplingParams(n=3, seed=10))
    assert [(s.index, s.prompt_index, s.sample_index) for s in subs] == [
        (0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 1, 0), (4, 1, 1), (5, 1, 2)]
    assert [s.params.seed for s in subs] == [10, 11, 12, 10, 11, 12] and all(s.params.n == 1 for s in subs)


def test_usage_counts_each_prompt_once_and_the_cache_hit_of_its_first_sample() -> None:
    usage = UsageTally(num_prompt_tokens=10, n=2)
    for index, cached in ((0, 8), (1, 4), (2, 0), (3, 0)):
        usage.add(ChoiceDelta(index, "x", 3, [], None, cached))
    assert usage.body() == {"prompt_tokens": 10, "completion_tokens": 12, "total_tokens": 22,
                            "prompt_tokens_details": {"cached_tokens": 8}}


def test_completion_logprobs_offsets_run_across_streamed_chunks() -> None:
    fmt = CompletionFormat(Header("cmpl-1", "m", 0), with_logprobs=True, include_usage=False)
    first = fmt.chunk(ChoiceDelta(0, "ab", 1, [TokenLogprob("ab", -0.5, [("ab", -0.5), ("c", -1.0)])], None, 0))
    second = fmt.chunk(ChoiceDelta(0, "cd", 1, [TokenLogprob("cd", -2.0, [("e", -0.1)])], "length", None))
    assert first is not None and second is not None and "usage" not in first
    assert first["choices"][0]["logprobs"]["text_offset"] == [0]
    logprobs = second["choices"][0]["logprobs"]
    assert logprobs["text_offset"] == [2] and logprobs["top_logprobs"] == [{"e": -0.1, "cd": -2.0}]
    assert second["choices"][0]["finish_reason"] == "length"


def test_chat_stream_opens_each_choice_with_its_role_and_closes_with_usage() -> None:
    fmt = ChatFormat(Header("chatcmpl-1", "m", 0), with_logprobs=False, include_usage=True)
    openings = fmt.opening(2)
    assert [o["choices"][0]["index"] for o in openings] == [0, 1]
    assert all(o["choices"][0]["delta"] == {"role": "assistant", "content": ""} and o["usage"] is None
               for o in openings)
    assert fmt.chunk(ChoiceDelta(1, "", 1, [], None, None)) is None  # nothing to say yet
    closing = fmt.closing(UsageTally(3, 1))
    assert closing["choices"] == [] and closing["usage"]["prompt_tokens"] == 3


def test_node_errors_map_to_http_statuses() -> None:
    def status(code: grpc.StatusCode) -> int:
        return api_error(NodeError("d", code, "x", retryable=False)).status

    assert status(grpc.StatusCode.INVALID_ARGUMENT) == 400 and status(grpc.StatusCode.UNAVAILABLE) == 503
    assert status(grpc.StatusCode.RESOURCE_EXHAUSTED) == 429 and status(grpc.StatusCode.DATA_LOSS) == 502


def test_node_errors_reach_clients_without_internal_addresses() -> None:
    gone = NodeError("prefill 10.0.0.7:50051", grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; "
                     "last error: UNKNOWN: ipv4:10.0.0.7:50051: Connection refused", retryable=True, unreachable=True)
    failed = NodeError("decode p-0.tandem.svc.cluster.local:50052", grpc.StatusCode.ABORTED,
                       "KV transfer failed: peer 10.0.0.8:15002 (p-0.tandem.svc.cluster.local:50052) closed",
                       retryable=True)
    for error, status in ((gone, 503), (failed, 502)):
        e = api_error(error)
        assert e.status == status and e.code == error.code.name.lower()
        for internal in ("10.0.0.", "50051", "50052", "15002", "svc.cluster"):
            assert internal not in e.message, e.message
    assert api_error(failed).message.startswith("the decode node failed the request: KV transfer failed")


class ScriptedPipeline(PDPipeline):
    """A PDPipeline (with a real, empty directory and router) whose requests are scripted, to test the proxy's
    bookkeeping: each request streams `token_ids` as one-token chunks (choice 1 fails at its `fail_at`th), the
    last with `finish_reason`, and records whether its stream was closed before the end."""

    def __init__(self, token_ids: list[int], fail_at: int | None = None,
                 finish_reason: FinishReason = FinishReason.LENGTH) -> None:
        directory = NodeDirectory()
        super().__init__(directory, Router(directory))
        self.token_ids = token_ids
        self.fail_at = fail_at
        self.finish_reason = finish_reason
        self.closed_early: list[str] = []

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       deadline: float) -> AsyncGenerator[TokenChunk, None]:
        done = False
        try:
            for i, token_id in enumerate(self.token_ids):
                await asyncio.sleep(0.001)
                if self.fail_at == i and request_id.endswith("-1"):
                    raise NodeError("decode", grpc.StatusCode.DATA_LOSS, "checksum mismatch", retryable=False)
                last = i == len(self.token_ids) - 1
                yield TokenChunk([token_id], [{token_id: Logprob(-0.1, 1)}], self.finish_reason if last else None,
                                 num_cached_tokens=4 if i == 0 else None)
            done = True
        finally:
            if not done:
                self.closed_early.append(request_id)


def _state(tokenizer_dir: Path, pipeline: ScriptedPipeline) -> ProxyState:
    from transformers import AutoTokenizer

    return ProxyState(pipeline, AutoTokenizer.from_pretrained(str(tokenizer_dir)), "m")


def test_an_error_in_one_choice_closes_the_others(tokenizer_dir: Path) -> None:
    pipeline = ScriptedPipeline(list(range(100, 150)), fail_at=3)
    state = _state(tokenizer_dir, pipeline)

    async def run() -> None:
        with pytest.raises(APIError) as e:
            async for _ in generate(state, "r", fan_out([[1, 2]], SamplingParams(n=3)), 0.0):
                pass
        assert e.value.status == 502 and "checksum" in e.value.message

    asyncio.run(run())
    assert sorted(pipeline.closed_early) == ["r-0", "r-1", "r-2"] and state.num_running == 0


def test_closing_a_request_closes_every_choice_and_counts_aborts(tokenizer_dir: Path) -> None:
    pipeline = ScriptedPipeline(list(range(100, 150)))
    state = _state(tokenizer_dir, pipeline)

    async def run() -> None:
        deltas = generate(state, "r", fan_out([[1, 2]], SamplingParams(n=2)), 0.0)
        assert (await anext(deltas)).num_cached_tokens == 4
        assert state.num_running == 2
        await deltas.aclose()

    asyncio.run(run())
    assert sorted(pipeline.closed_early) == ["r-0", "r-1"] and state.num_running == 0
    assert b'tandem:request_success_total{finished_reason="abort",model_name="m"} 2.0' in state.metrics.render()


def test_a_choice_that_runs_to_the_end_is_recorded_with_its_finish_reason(tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    letters = AutoTokenizer.from_pretrained(str(tokenizer_dir)).convert_tokens_to_ids(["A", "B", "C"])
    state = _state(tokenizer_dir, ScriptedPipeline(letters))

    async def run() -> list[ChoiceDelta]:
        return [d async for d in generate(state, "r", fan_out([[1, 2]], SamplingParams(logprobs=0)), 0.0)]

    deltas = asyncio.run(run())
    assert "".join(d.text for d in deltas) == "ABC" and deltas[-1].finish_reason == "length"
    assert [e.token for d in deltas for e in d.logprobs] == ["A", "B", "C"]
    text = state.metrics.render().decode()
    assert 'tandem:request_success_total{finished_reason="length",model_name="m"} 1.0' in text
    assert 'tandem:generation_tokens_total{model_name="m"} 3.0' in text
    assert 'tandem:time_to_first_token_seconds_count{model_name="m"} 1.0' in text


def _run_letters(tokenizer_dir: Path, letters: list[str], params: SamplingParams,
                 finish_reason: FinishReason = FinishReason.LENGTH, eos: bool = False
                 ) -> tuple[ProxyState, ScriptedPipeline, list[ChoiceDelta]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    token_ids = tokenizer.convert_tokens_to_ids(letters) + ([tokenizer.eos_token_id] if eos else [])
    pipeline = ScriptedPipeline(token_ids, finish_reason=finish_reason)
    state = _state(tokenizer_dir, pipeline)

    async def run() -> list[ChoiceDelta]:
        return [d async for d in generate(state, "r", fan_out([[1, 2]], params), 0.0)]

    return state, pipeline, asyncio.run(run())


def test_the_eos_text_is_not_shown_even_without_skipping_special_tokens(tokenizer_dir: Path) -> None:
    state, _, deltas = _run_letters(tokenizer_dir, ["A", "B"], SamplingParams(skip_special_tokens=False),
                                    FinishReason.STOP, eos=True)
    assert "".join(d.text for d in deltas) == "AB" and deltas[-1].finish_reason == "stop"
    assert sum(d.num_tokens for d in deltas) == 3  # the EOS token is generated, and counted


def test_a_stop_string_ends_the_choice_and_closes_its_pipeline_stream(tokenizer_dir: Path) -> None:
    state, pipeline, deltas = _run_letters(tokenizer_dir, ["A", "B", "C", "D", "E"], SamplingParams(stop="BC"))
    assert "".join(d.text for d in deltas) == "A" and deltas[-1].finish_reason == "stop"
    assert [d.text for d in deltas] == ["A", "", ""]  # "B" might have begun "BC": held back, then cut
    assert sum(d.num_tokens for d in deltas) == 3 and pipeline.closed_early == ["r-0"]
    assert 'tandem:request_success_total{finished_reason="stop",model_name="m"} 1.0' in state.metrics.render().decode()


def test_health_and_metrics_read_the_pipelines_directory_and_router(tokenizer_dir: Path) -> None:
    import httpx

    state = _state(tokenizer_dir, ScriptedPipeline([1]))
    state.pipeline.router.decision_counts["colocated"] += 2

    async def run() -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as http:
            return await http.get("/health"), await http.get("/metrics")

    health, metrics = asyncio.run(run())
    assert health.status_code == 503  # no decode node in the directory
    assert health.json() == {"status": "unavailable", "ready_nodes": {"prefill": 0, "decode": 0}}
    assert metrics.status_code == 200
    assert 'tandem:pd_decisions_total{mode="colocated",model_name="m"} 2.0' in metrics.text


def test_a_method_the_path_does_not_take_gets_405_with_allow_and_the_envelope(tokenizer_dir: Path) -> None:
    """Found by schemathesis' unsupported_method check: the 405 lost starlette's Allow header (RFC 9110 wants it)."""
    import httpx

    state = _state(tokenizer_dir, ScriptedPipeline([1]))

    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as http:
            return await http.delete("/v1/completions")

    response = asyncio.run(run())
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json()["error"]["code"] == "method_not_allowed"
