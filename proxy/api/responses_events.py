"""The Responses API's output: a response object's items, built as one choice's deltas arrive, and the server-sent
events that say so (OpenAI's event types, each with its sequence_number).

Items come in the order of their text: a reasoning item (what a --reasoning-parser split off, as reasoning_text
content), a message item (the answer's text, as one output_text part), one function_call item per tool call. A
response with neither text nor calls still has its (empty) message item, as OpenAI's always has an answer.

A stream's events:
1. response.created, response.in_progress: the response, status in_progress, no output yet;
2. per item: response.output_item.added (and response.content_part.added for a message or reasoning), its deltas
   (response.output_text.delta, response.reasoning_text.delta, response.function_call_arguments.delta), then once the
   next item starts or the choice ends its done events (…text.done / …arguments.done, response.content_part.done,
   response.output_item.done);
3. response.completed, or response.incomplete (max_output_tokens reached) with incomplete_details, or
   response.failed with the error that ended it.
A whole response runs through the same builder, its events unread: streamed and whole answers have one shape.
"""

from __future__ import annotations

import enum
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from proxy.api.errors import APIError
from proxy.api.parsers.base import ToolCallDelta
from proxy.api.responses import ChoiceDelta, TokenLogprob, UsageTally, new_call_id

Event = dict[str, Any]


@dataclass(frozen=True)
class ResponseEcho:
    """The request's settings, as the response object repeats them (the SDK's Response model requires most)."""

    instructions: str | None
    tools: list[dict[str, Any]]  # the function tools as sent (flat)
    tool_choice: Any  # as sent, or its default
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    max_output_tokens: int | None
    top_logprobs: int | None
    text: dict[str, Any]  # {"format": ...}
    reasoning: dict[str, Any] | None
    metadata: dict[str, str] | None
    user: str | None
    with_logprobs: bool  # include ["message.output_text.logprobs"]

    def body(self) -> dict[str, Any]:
        return {"instructions": self.instructions, "tools": self.tools, "tool_choice": self.tool_choice,
                "parallel_tool_calls": self.parallel_tool_calls, "temperature": self.temperature,
                "top_p": self.top_p, "max_output_tokens": self.max_output_tokens, "top_logprobs": self.top_logprobs,
                "text": self.text, "reasoning": self.reasoning, "metadata": self.metadata or {}, "user": self.user,
                "truncation": "disabled", "store": False, "background": False, "previous_response_id": None}


class ItemKind(enum.Enum):
    REASONING = "reasoning"
    MESSAGE = "message"
    FUNCTION_CALL = "function_call"


@dataclass
class OutputItem:
    kind: ItemKind
    id: str
    text: str = ""  # a message's or the reasoning's text; a call's arguments
    name: str = ""  # a call's
    call_id: str = ""  # a call's
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # a message's, when asked for
    status: str = "in_progress"

    def part(self, with_logprobs: bool) -> dict[str, Any]:
        """A message's or a reasoning item's one content part."""
        if self.kind is ItemKind.REASONING:
            return {"type": "reasoning_text", "text": self.text}
        part: dict[str, Any] = {"type": "output_text", "text": self.text, "annotations": []}
        if with_logprobs:
            part["logprobs"] = self.logprobs
        return part

    def body(self, with_logprobs: bool, added: bool = False) -> dict[str, Any]:
        """The item; `added`: as output_item.added shows it, before any of its text."""
        if self.kind is ItemKind.FUNCTION_CALL:
            return {"type": "function_call", "id": self.id, "call_id": self.call_id, "name": self.name,
                    "arguments": "" if added else self.text, "status": self.status}
        content = [] if added else [self.part(with_logprobs)]
        if self.kind is ItemKind.REASONING:
            return {"type": "reasoning", "id": self.id, "summary": [], "content": content, "status": self.status}
        return {"type": "message", "id": self.id, "role": "assistant", "status": self.status, "content": content}


def sse_event(event: Event) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def _logprob(entry: TokenLogprob) -> dict[str, Any]:
    def token(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", errors="replace"))}

    return {**token(entry.token, entry.logprob), "top_logprobs": [token(t, lp) for t, lp in entry.top]}


class ResponseOutput:
    """One response's output, fed one choice's deltas; each call returns the events it makes."""

    def __init__(self, response_id: str, model: str, created_at: int, echo: ResponseEcho, num_prompt_tokens: int
                 ) -> None:
        self.response_id = response_id
        self.model = model
        self.created_at = created_at
        self.echo = echo
        self.items: list[OutputItem] = []
        self.current: OutputItem | None = None  # the item whose text is arriving
        self.calls: dict[int, OutputItem] = {}  # a choice's call index -> its item
        self.usage = UsageTally(num_prompt_tokens, 1)
        self.finish_reason: str | None = None
        self.pending_logprobs: list[dict[str, Any]] = []  # of tokens whose text has not come yet
        self.num_events = 0

    def opening(self) -> list[Event]:
        snapshot = self.body("in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def feed(self, delta: ChoiceDelta) -> list[Event]:
        self.usage.add(delta)
        self.finish_reason = delta.finish_reason or self.finish_reason
        if self.echo.with_logprobs:
            self.pending_logprobs += [_logprob(e) for e in delta.logprobs]
        events = self._reasoning(delta.reasoning) if delta.reasoning else []
        if delta.text:
            events += self._text(delta.text)
        for piece in delta.tool_calls:
            events += self._call(piece)
        return events

    def closing(self) -> list[Event]:
        """The done events of the last item and the response's own: completed, or incomplete on max_output_tokens."""
        events = [] if self.items else self._open(OutputItem(ItemKind.MESSAGE, f"msg_{uuid.uuid4().hex}"))
        if self.current is not None and self.current.kind is ItemKind.MESSAGE:
            self.current.logprobs += self.pending_logprobs  # tokens whose text was held back to the end
        incomplete = self.finish_reason == "length"
        events += self._close(incomplete)
        status = "incomplete" if incomplete else "completed"
        return events + [self._event(f"response.{status}", response=self.body(status))]

    def failed(self, error: APIError) -> list[Event]:
        if self.current is not None:
            self.current.status = "incomplete"
        # ResponseError's codes: the SDK's model admits these
        code = "rate_limit_exceeded" if error.status == 429 else "invalid_prompt" if error.status < 500 else \
            "server_error"
        return [self._event("response.failed", response=self.body("failed", {"code": code, "message": error.message}))]

    def body(self, status: str, error: dict[str, str] | None = None) -> dict[str, Any]:
        """The response object; output and usage are whole once the response is no longer in progress."""
        done = status != "in_progress"
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        usage = None if not done else {
            "input_tokens": self.usage.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": self.usage.num_cached_tokens, "cache_write_tokens": 0},
            "output_tokens": self.usage.num_completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.usage.num_prompt_tokens + self.usage.num_completion_tokens}
        return {"id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
                "error": error, "incomplete_details": incomplete, "model": self.model,
                "output": [item.body(self.echo.with_logprobs) for item in self.items] if done else [],
                "usage": usage, **self.echo.body()}

    # ---- items ----

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self.num_events, **fields}
        self.num_events += 1
        return event

    def _where(self, item: OutputItem) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": self.items.index(item)}

    def _open(self, item: OutputItem) -> list[Event]:
        events = self._close(False)
        self.items.append(item)
        self.current = item
        events.append(self._event("response.output_item.added", output_index=len(self.items) - 1,
                                  item=item.body(self.echo.with_logprobs, added=True)))
        if item.kind is not ItemKind.FUNCTION_CALL:
            empty = OutputItem(item.kind, item.id).part(self.echo.with_logprobs)
            events.append(self._event("response.content_part.added", **self._where(item), content_index=0, part=empty))
        return events

    def _close(self, incomplete: bool) -> list[Event]:
        item = self.current
        if item is None:
            return []
        self.current = None
        item.status = "incomplete" if incomplete else "completed"
        where = self._where(item)
        if item.kind is ItemKind.FUNCTION_CALL:
            events = [self._event("response.function_call_arguments.done", **where, arguments=item.text)]
        else:
            part = item.part(self.echo.with_logprobs)
            if item.kind is ItemKind.REASONING:
                done = self._event("response.reasoning_text.done", **where, content_index=0, text=item.text)
            else:
                done = self._event("response.output_text.done", **where, content_index=0, text=item.text,
                                   logprobs=item.logprobs)
            events = [done, self._event("response.content_part.done", **where, content_index=0, part=part)]
        return [*events, self._event("response.output_item.done", output_index=where["output_index"],
                                     item=item.body(self.echo.with_logprobs))]

    def _current(self, kind: ItemKind, prefix: str) -> tuple[OutputItem, list[Event]]:
        if self.current is not None and self.current.kind is kind:
            return self.current, []
        item = OutputItem(kind, f"{prefix}_{uuid.uuid4().hex}")
        return item, self._open(item)

    def _reasoning(self, text: str) -> list[Event]:
        item, events = self._current(ItemKind.REASONING, "rs")
        item.text += text
        return [*events, self._event("response.reasoning_text.delta", **self._where(item), content_index=0,
                                     delta=text)]

    def _text(self, text: str) -> list[Event]:
        item, events = self._current(ItemKind.MESSAGE, "msg")
        item.text += text
        # the tokens' since the last text: a token's text may come later than the token (stop strings, parsers)
        logprobs, self.pending_logprobs = self.pending_logprobs, []
        item.logprobs += logprobs
        return [*events, self._event("response.output_text.delta", **self._where(item), content_index=0, delta=text,
                                     logprobs=logprobs)]

    def _call(self, piece: ToolCallDelta) -> list[Event]:
        events: list[Event] = []
        if piece.name is not None:  # a call's first piece
            item = OutputItem(ItemKind.FUNCTION_CALL, f"fc_{uuid.uuid4().hex}", name=piece.name, call_id=new_call_id())
            self.calls[piece.index] = item
            events = self._open(item)
        item = self.calls[piece.index]
        assert item is self.current, "a parser streams one call at a time, each whole before the next"
        if not piece.arguments:
            return events
        item.text += piece.arguments
        return [*events, self._event("response.function_call_arguments.delta", **self._where(item),
                                     delta=piece.arguments)]
