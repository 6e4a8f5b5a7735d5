"""One streamed request against /v1/completions or /v1/chat/completions, timed on the client.

Timings (seconds, `time.perf_counter`): TTFT is from sending the request to the first chunk that carries text;
each later chunk with text adds one inter-token latency (ITL: the gap since the previous one; a chunk may hold
more than one token, as it does in vLLM's client); the end-to-end latency runs to the end of the stream. The
output token count is the usage chunk's `completion_tokens` (asked for with `stream_options.include_usage`),
or, if the server sends none, the number of chunks with text; the whole usage record, with the prompt's
prefix-cache hit (`usage.prompt_tokens_details.cached_tokens`), is kept as `Usage`. A request succeeds when its
stream ends with `data: [DONE]` after at least one token (if no token had any text, its TTFT is its whole
latency).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmark.datasets import SampleRequest
from benchmark.sse import DONE, SSEDecoder

CHAT_ENDPOINTS = ("/v1/chat/completions",)


@dataclass(frozen=True)
class RequestSettings:
    """What every request of a run shares."""

    api_url: str  # base URL + endpoint
    model: str
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, ... (sent as given)
    api_key: str | None = None

    @property
    def chat(self) -> bool:
        return self.api_url.rstrip("/").endswith(CHAT_ENDPOINTS)


@dataclass(frozen=True)
class Usage:
    """The server's usage record from the stream's final usage chunk."""

    prompt_tokens: int
    completion_tokens: int | None  # None where the record lacks it (the chunks with text are counted instead)
    cached_tokens: int | None  # prompt_tokens_details.cached_tokens; None where the server does not report it


@dataclass
class RequestOutput:
    """What the client saw of one request. `error` is set (and `success` False) for a failed one."""

    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    generated_text: str = ""
    success: bool = False
    error: str = ""
    usage: Usage | None = None  # None where the server sent no usage chunk
    session_turn: int | None = None  # multi-turn-session: the turn's number in its session (1 = first)


def request_body(settings: RequestSettings, sample: SampleRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": settings.model,
        "max_tokens": sample.expected_output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if settings.chat:
        messages = sample.messages or ()
        body["messages"] = ([{"role": m.role, "content": m.content} for m in messages]
                            or [{"role": "user", "content": sample.prompt}])
    else:
        body["prompt"] = sample.prompt
    if settings.ignore_eos:
        body["ignore_eos"] = True
    body.update(settings.extra_body)
    return body


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        delta = choice["delta"] or {}
        return str(delta.get("content") or delta.get("reasoning_content") or "")
    return str(choice.get("text") or "")


def _usage(usage: dict[str, Any]) -> Usage:
    details = usage.get("prompt_tokens_details") or {}
    completion, cached = usage.get("completion_tokens"), details.get("cached_tokens")
    return Usage(int(usage.get("prompt_tokens") or 0), None if completion is None else int(completion),
                 None if cached is None else int(cached))


async def send_request(client: httpx.AsyncClient, settings: RequestSettings, sample: SampleRequest
                       ) -> RequestOutput:
    """Send `sample`, stream the answer, and time it. Never raises for what the server does: errors are
    recorded in the output, so a failed request is counted, not lost."""
    output = RequestOutput(prompt_len=sample.prompt_len)
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    num_text_chunks = 0
    text_parts: list[str] = []
    saw_done = False
    start = time.perf_counter()
    output.start_time = start
    last = start
    try:
        async with client.stream("POST", settings.api_url, json=request_body(settings, sample),
                                 headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                output.error = f"HTTP {response.status_code}: {body[:500]}"
                return output
            decoder = SSEDecoder()
            async for line in response.aiter_lines():
                data = decoder.feed(line)
                if data is None:
                    continue
                if data == DONE:
                    saw_done = True
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    output.error = f"error event: {json.dumps(chunk['error'])[:500]}"
                    return output
                if text := _chunk_text(chunk):
                    if num_text_chunks == 0:
                        output.ttft = now - start
                    else:
                        output.itl.append(now - last)
                    last = now
                    num_text_chunks += 1
                    text_parts.append(text)
                if usage := chunk.get("usage"):
                    output.usage = _usage(usage)
                    output.prompt_len = output.usage.prompt_tokens or output.prompt_len
        output.latency = time.perf_counter() - start
    except Exception as e:  # a malformed or broken answer fails this request, never the whole run
        output.error = f"{type(e).__name__}: {e}"
        return output
    output.generated_text = "".join(text_parts)
    reported = output.usage.completion_tokens if output.usage is not None else None
    output.output_tokens = reported if reported is not None else num_text_chunks
    if not saw_done:
        output.error = "the stream ended without data: [DONE]"
    elif output.output_tokens == 0:
        output.error = "no tokens in the response"
    else:
        if num_text_chunks == 0:  # tokens that decode to no text (a model with ids its tokenizer lacks)
            output.ttft = output.latency
        output.success = True
    return output
