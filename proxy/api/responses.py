"""The OpenAI response shapes, as the official SDK parses them: completions and chat, whole and streamed.

serving.py turns tokens into ChoiceDeltas; the two formats here turn those into response bodies and chunks.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, field
from typing import Any

from proxy.api.parsers.base import ToolCallDelta

# JSON has no -inf; like vLLM, report impossible tokens with a very small finite logprob.
MIN_LOGPROB = -9999.0


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's logprob and the most likely alternatives at its position (best first)."""

    token: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass(frozen=True)
class ChoiceDelta:
    """What one step of one choice added."""

    index: int
    text: str
    num_tokens: int
    logprobs: list[TokenLogprob]  # one per token when logprobs were asked for
    finish_reason: str | None
    num_cached_tokens: int | None  # on a choice's first delta: the prefix-cache hit of its prefill
    reasoning: str = ""  # what a --reasoning-parser took out of the text
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    # on a choice's first delta, when prompt_logprobs were asked: vLLM's shape (None, then id -> logprob, rank, text)
    prompt_logprobs: list[dict[str, Any] | None] | None = None


@dataclass
class ResultCall:
    """A whole tool call of a choice."""

    name: str
    arguments: str = ""


@dataclass
class ChoiceResult:
    """A whole choice, for non-streaming responses."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    reasoning: str = ""
    tool_calls: list[ResultCall] = field(default_factory=list)
    prompt_logprobs: list[dict[str, Any] | None] | None = None

    def add(self, delta: ChoiceDelta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.text += delta.text
        self.reasoning += delta.reasoning
        self.logprobs += delta.logprobs
        self.finish_reason = delta.finish_reason or self.finish_reason
        for piece in delta.tool_calls:
            if piece.index == len(self.tool_calls):
                self.tool_calls.append(ResultCall(piece.name or ""))
            self.tool_calls[piece.index].arguments += piece.arguments


def new_call_id() -> str:
    """OpenAI's shape: call_ and 24 characters."""
    return f"call_{uuid.uuid4().hex[:24]}"


class UsageTally:
    """Token counts of one response. OpenAI counts a prompt once however many samples it has; the cached
    tokens are those of each prompt's first sample's prefill."""

    def __init__(self, num_prompt_tokens: int, n: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.n = n
        self.num_completion_tokens = 0
        self.num_cached_tokens = 0

    def add(self, delta: ChoiceDelta) -> None:
        self.num_completion_tokens += delta.num_tokens
        if delta.num_cached_tokens is not None and delta.index % self.n == 0:
            self.num_cached_tokens += delta.num_cached_tokens

    def body(self) -> dict[str, Any]:
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": self.num_completion_tokens,
                "total_tokens": self.num_prompt_tokens + self.num_completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens}}


def sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


@dataclass(frozen=True)
class Header:
    """What every object of one response shares."""

    request_id: str
    model: str
    created: int


@dataclass(frozen=True)
class EchoedPrompt:
    """What `echo` puts before a completion: the prompt's text and, for its logprobs, its token ids and the first
    token's text (the first position has no logprob, hence no entry to take the text from)."""

    text: str
    token_ids: list[int]
    first_token_text: str

    def legacy_logprobs(self, positions: list[dict[str, Any] | None] | None
                        ) -> tuple[list[str], list[float | None], list[dict[str, float] | None]]:
        """tokens, token_logprobs, top_logprobs of the prompt, from vLLM-shaped prompt_logprobs."""
        tokens: list[str] = [self.first_token_text]
        token_logprobs: list[float | None] = [None]
        tops: list[dict[str, float] | None] = [None]
        for i, token_id in enumerate(self.token_ids[1:], start=1):
            position = (positions[i] if positions is not None and i < len(positions) else None) or {}
            own = position.get(str(token_id), {})
            tokens.append(own.get("decoded_token") or "")
            token_logprobs.append(own.get("logprob"))
            tops.append({entry["decoded_token"]: entry["logprob"] for entry in position.values()})
        return tokens, token_logprobs, tops


class CompletionFormat:
    """/v1/completions: object "text_completion", choices with `text` and legacy logprobs; with `echo`, each
    choice's text (and logprobs) starts with its prompt's."""

    id_prefix = "cmpl"

    def __init__(self, header: Header, with_logprobs: bool, include_usage: bool,
                 echo: list[EchoedPrompt] | None = None, n: int = 1) -> None:
        self.header = header
        self.with_logprobs = with_logprobs
        self.include_usage = include_usage
        self.text_offsets: dict[int, int] = {}  # per choice, for the logprobs' text_offset
        self.echo = echo  # per prompt
        self.n = n
        self.echoed: set[int] = set()  # choices whose first chunk went out

    def _body(self, choices: list[dict[str, Any]], with_usage_field: bool, usage: dict[str, Any] | None = None
              ) -> dict[str, Any]:
        body = {"id": self.header.request_id, "object": "text_completion", "created": self.header.created,
                "model": self.header.model, "choices": choices}
        if with_usage_field:
            body["usage"] = usage
        return body

    def _logprobs(self, index: int, entries: list[TokenLogprob], echoed: tuple[list[str], list[float | None],
                  list[dict[str, float] | None]] | None = None) -> dict[str, Any] | None:
        """The legacy format. Its top_logprobs hold the sampled token too, as vLLM's do."""
        if not self.with_logprobs:
            return None
        tokens, token_logprobs, tops = echoed or ([], [], [])
        tokens = [*tokens, *(e.token for e in entries)]
        token_logprobs = [*token_logprobs, *(e.logprob for e in entries)]
        tops = [*tops, *({**dict(e.top), e.token: e.logprob} for e in entries)]
        offset = self.text_offsets.get(index, 0)
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self.text_offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _choice(self, index: int, text: str, finish_reason: str | None, entries: list[TokenLogprob],
                prompt_logprobs: list[dict[str, Any] | None] | None = None, first: bool = False) -> dict[str, Any]:
        echoed = None
        if first and self.echo is not None:
            prompt = self.echo[index // self.n]
            text = prompt.text + text
            echoed = prompt.legacy_logprobs(prompt_logprobs)
        choice = {"index": index, "text": text, "logprobs": self._logprobs(index, entries, echoed),
                  "finish_reason": finish_reason}
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs
        return choice

    def opening(self, num_choices: int) -> list[dict[str, Any]]:
        return []

    def chunk(self, delta: ChoiceDelta) -> dict[str, Any] | None:
        first = delta.index not in self.echoed
        opens = first and (self.echo is not None or delta.prompt_logprobs is not None)  # its first chunk says more
        if not (delta.text or delta.finish_reason or (self.with_logprobs and delta.logprobs) or opens):
            return None
        self.echoed.add(delta.index)
        choice = self._choice(delta.index, delta.text, delta.finish_reason, delta.logprobs, delta.prompt_logprobs,
                              first)
        return self._body([choice], self.include_usage)

    def closing(self, usage: UsageTally) -> dict[str, Any]:
        return self._body([], True, usage.body())

    def whole(self, results: list[ChoiceResult], usage: UsageTally) -> dict[str, Any]:
        choices = [self._choice(r.index, r.text, r.finish_reason, r.logprobs, r.prompt_logprobs, True)
                   for r in results]
        return self._body(choices, True, usage.body())


class ChatFormat:
    """/v1/chat/completions: object "chat.completion" with `message`s, or "chat.completion.chunk" with
    `delta`s: the first chunk of each choice carries the role, the last its finish_reason."""

    id_prefix = "chatcmpl"

    def __init__(self, header: Header, with_logprobs: bool, include_usage: bool) -> None:
        self.header = header
        self.with_logprobs = with_logprobs
        self.include_usage = include_usage
        self.call_ids: dict[tuple[int, int], str] = {}  # (choice, call) -> its id, made at the call's first piece

    def _body(self, obj: str, choices: list[dict[str, Any]], with_usage_field: bool,
              usage: dict[str, Any] | None = None) -> dict[str, Any]:
        body = {"id": self.header.request_id, "object": obj, "created": self.header.created,
                "model": self.header.model, "choices": choices}
        if with_usage_field:
            body["usage"] = usage
        return body

    def _logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        if not self.with_logprobs:
            return None

        def token(text: str, logprob: float) -> dict[str, Any]:
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", errors="replace"))}

        return {"content": [{**token(e.token, e.logprob), "top_logprobs": [token(t, lp) for t, lp in e.top]}
                            for e in entries], "refusal": None}

    def _delta_choice(self, index: int, delta: dict[str, Any], finish_reason: str | None,
                      entries: list[TokenLogprob]) -> dict[str, Any]:
        logprobs = self._logprobs(entries) if entries else None
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def opening(self, num_choices: int) -> list[dict[str, Any]]:
        return [self._body("chat.completion.chunk",
                           [self._delta_choice(i, {"role": "assistant", "content": ""}, None, [])],
                           self.include_usage) for i in range(num_choices)]

    def chunk(self, delta: ChoiceDelta) -> dict[str, Any] | None:
        if not (delta.text or delta.reasoning or delta.tool_calls or delta.finish_reason
                or (self.with_logprobs and delta.logprobs)):
            return None
        content: dict[str, Any] = {}
        if delta.reasoning:
            content["reasoning_content"] = delta.reasoning
        if delta.text:
            content["content"] = delta.text
        if delta.tool_calls:
            content["tool_calls"] = [self._call_piece(delta.index, piece) for piece in delta.tool_calls]
        choice = self._delta_choice(delta.index, content, delta.finish_reason, delta.logprobs)
        body = self._body("chat.completion.chunk", [choice], self.include_usage)
        if delta.prompt_logprobs is not None:
            body["prompt_logprobs"] = delta.prompt_logprobs  # vLLM's place: the response's, one prompt
        return body

    def _call_piece(self, choice: int, piece: ToolCallDelta) -> dict[str, Any]:
        """OpenAI's stream shape: a call's first piece carries index, id, type and name; later ones only index and
        an arguments fragment (the SDK's accumulator concatenates them)."""
        if piece.name is None:
            return {"index": piece.index, "function": {"arguments": piece.arguments}}
        call_id = self.call_ids.setdefault((choice, piece.index), new_call_id())
        return {"index": piece.index, "id": call_id, "type": "function",
                "function": {"name": piece.name, "arguments": piece.arguments}}

    def closing(self, usage: UsageTally) -> dict[str, Any]:
        return self._body("chat.completion.chunk", [], True, usage.body())

    def whole(self, results: list[ChoiceResult], usage: UsageTally) -> dict[str, Any]:
        choices = [{"index": r.index, "message": self._message(r), "logprobs": self._logprobs(r.logprobs),
                    "finish_reason": r.finish_reason} for r in results]
        body = self._body("chat.completion", choices, True, usage.body())
        if results and results[0].prompt_logprobs is not None:
            body["prompt_logprobs"] = results[0].prompt_logprobs  # vLLM's place: the response's, one prompt
        return body

    @staticmethod
    def _message(result: ChoiceResult) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": result.text, "refusal": None}
        if result.reasoning:
            message["reasoning_content"] = result.reasoning
        if result.tool_calls:
            message["content"] = result.text or None  # OpenAI's: no text beside the calls is null
            message["tool_calls"] = [{"id": new_call_id(), "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in result.tool_calls]
        return message
