"""One streamed request against a fake OpenAI server (httpx's mock transport): what is timed and counted, and
that failures are recorded with their error."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx

from benchmark.client import RequestOutput, RequestSettings, Usage, request_body, send_request
from benchmark.datasets import ChatMessage, SampleRequest

SAMPLE = SampleRequest(prompt="hi", prompt_len=2, expected_output_len=3)


def _sse(*chunks: object, done: bool = True) -> bytes:
    events = [f"data: {json.dumps(c)}\n\n" for c in chunks] + (["data: [DONE]\n\n"] if done else [])
    return "".join(events).encode()


def _send(handler: Callable[[httpx.Request], httpx.Response], endpoint: str = "/v1/completions") -> RequestOutput:
    async def go() -> RequestOutput:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send_request(client, RequestSettings(f"http://test{endpoint}", "m"), SAMPLE)
    return asyncio.run(go())


def test_text_chunks_give_ttft_and_itls_and_usage_gives_the_token_count() -> None:
    body = _sse({"choices": [{"text": "a"}]}, {"choices": [{"text": ""}]}, {"choices": [{"text": "b"}]},
                {"choices": [{"text": "c", "finish_reason": "length"}]},
                {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}})
    out = _send(lambda request: httpx.Response(200, content=body))
    assert out.success and out.error == ""
    assert out.generated_text == "abc"
    assert len(out.itl) == 2  # the empty chunk is no token
    assert (out.output_tokens, out.prompt_len) == (4, 5)  # the server's counts win
    assert 0 < out.ttft <= out.latency


def test_chat_deltas_are_read_and_without_usage_the_chunks_are_counted() -> None:
    body = _sse({"choices": [{"delta": {"role": "assistant"}}]}, {"choices": [{"delta": {"content": "x"}}]},
                {"choices": [{"delta": {"content": "y"}}]})
    out = _send(lambda request: httpx.Response(200, content=body), "/v1/chat/completions")
    assert out.success and out.generated_text == "xy" and out.output_tokens == 2


def test_http_errors_broken_streams_and_error_events_are_failures_with_their_error() -> None:
    out = _send(lambda request: httpx.Response(503, content=b"overloaded"))
    assert not out.success and out.error == "HTTP 503: overloaded"
    out = _send(lambda request: httpx.Response(200, content=_sse({"choices": [{"text": "a"}]}, done=False)))
    assert not out.success and "[DONE]" in out.error
    out = _send(lambda request: httpx.Response(200, content=_sse({"error": {"message": "bad"}})))
    assert not out.success and "bad" in out.error
    out = _send(lambda request: httpx.Response(200, content=b"data: [1, 2]\n\ndata: {oops\n\n"))
    assert not out.success and out.error.startswith("AttributeError")

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")
    out = _send(refuse)
    assert not out.success and out.error == "ConnectError: refused"


def test_request_bodies_ask_for_usage_and_carry_messages_for_chat() -> None:
    history = (ChatMessage("user", "q"), ChatMessage("assistant", "r"), ChatMessage("user", "s"))
    sample = SampleRequest("q", 1, 7, history)
    chat = request_body(RequestSettings("http://x/v1/chat/completions", "m", ignore_eos=True,
                                        extra_body={"temperature": 0}), sample)
    assert chat["messages"] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"},
                                {"role": "user", "content": "s"}]
    assert (chat["max_tokens"], chat["ignore_eos"], chat["temperature"]) == (7, True, 0)
    assert chat["stream_options"] == {"include_usage": True} and chat["stream"] is True
    completion = request_body(RequestSettings("http://x/v1/completions", "m"), SAMPLE)
    assert completion["prompt"] == "hi" and "ignore_eos" not in completion and "messages" not in completion


def test_tokens_without_text_still_complete_and_no_tokens_at_all_fail() -> None:
    body = _sse({"choices": [{"text": ""}]}, {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2}})
    out = _send(lambda request: httpx.Response(200, content=body))
    assert out.success and out.output_tokens == 2 and out.ttft == out.latency
    out = _send(lambda request: httpx.Response(200, content=_sse({"choices": [{"text": ""}]})))
    assert not out.success and out.error == "no tokens in the response"


def test_the_usage_record_keeps_the_prompts_cached_tokens() -> None:
    usage = {"prompt_tokens": 40, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 32}}
    body = _sse({"choices": [{"delta": {"content": "x"}}]}, {"choices": [], "usage": usage})
    out = _send(lambda request: httpx.Response(200, content=body), "/v1/chat/completions")
    assert out.success and out.usage == Usage(40, 1, 32) and out.prompt_len == 40
    body = _sse({"choices": [{"text": "a"}]}, {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}})
    assert _send(lambda request: httpx.Response(200, content=body)).usage == Usage(3, 1, None)
    assert _send(lambda request: httpx.Response(200, content=_sse({"choices": [{"text": "a"}]}))).usage is None
