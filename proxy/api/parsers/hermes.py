"""vLLM's `hermes` tool-call format (Hermes 2 Pro/3, Qwen2.5, Qwen3): each call is a JSON object between tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

with free text before the first call and between calls. As vLLM: the text before the first `<tool_call>` is
content; a body that is complete JSON counts even where the output ends before its `</tool_call>`. Beyond vLLM
(which drops everything after the first call from the content): text between and after calls is content too,
unless it is only whitespace; a call whose body is not a call object goes out as content, tags and all.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from proxy.api.parsers.base import (
    CallLog,
    ParsedText,
    Segments,
    SteppedParser,
    ToolCall,
    ToolParser,
    ToolStructure,
    call_from_json,
    head_name,
    held_prefix,
    loads_json,
)

START = "<tool_call>"
END = "</tool_call>"


def _call(body: str) -> ToolCall | None:
    try:
        obj = loads_json(body.strip())
    except ValueError:
        return None
    return call_from_json(obj, arguments_required=False)


class HermesToolParser(SteppedParser, ToolParser):
    name = "hermes"

    def __init__(self) -> None:
        self._buf = ""  # text not yet released: a held tail of content, or the open call's body
        self._in_call = False
        self._end_from = 0  # where the search for the open call's END goes on (the body before has none)
        self._space_before = ""  # whitespace held before the open call: content again if the call fails
        self._log = CallLog()
        self._segments = Segments()

    def _ended(self, out: ParsedText) -> None:
        out.content += self._segments.flush(bool(self._log.calls))

    def calls(self) -> list[ToolCall]:
        return list(self._log.calls)

    @classmethod
    def structures(cls, tools: Sequence[tuple[str, dict[str, Any]]]) -> tuple[list[ToolStructure], list[str]] | None:
        # What Qwen2.5's and Hermes' templates show the model (and vLLM's structural tag for hermes).
        return [ToolStructure(f'{START}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ',
                              schema, f"}}\n{END}") for name, schema in tools], [START]

    def _step(self, out: ParsedText, final: bool) -> bool:
        """One move; False when it needs more text."""
        return self._call_step(out, final) if self._in_call else self._content_step(out, final)

    def _content_step(self, out: ParsedText, final: bool) -> bool:
        at = self._content_before(out, self._segments, START, final)
        if at is None:
            return False
        self._space_before = self._segments.call_opened()
        self._buf = self._buf[at + len(START):]
        self._in_call, self._end_from = True, 0
        return True

    def _call_step(self, out: ParsedText, final: bool) -> bool:
        end = self._buf.find(END, self._end_from)
        if end >= 0:
            body, self._buf = self._buf[:end], self._buf[end + len(END):]
            self._close(out, body, START + body + END)
            return True
        # an END split between pieces is found from here next time
        self._end_from = max(0, len(self._buf) - len(END) + 1)
        if not final:
            self._send_name(out, self._buf)
            return False
        # The output ended inside the call: vLLM takes a body that is whole JSON (the model stopped before its END).
        body, raw = self._buf[:len(self._buf) - held_prefix(self._buf, END)], START + self._buf
        self._buf = ""
        self._close(out, body, raw)
        return False

    def _close(self, out: ParsedText, body: str, raw: str) -> None:
        self._in_call = False
        self._send_name(out, body)
        call = _call(body)
        if call is not None and self._log.accept(out, call):
            self._segments.call_closed()
            return
        self._log.drop()
        out.content += self._segments.add(self._space_before + raw)

    def _send_name(self, out: ParsedText, body: str) -> None:
        """Send the call's name once its head is written; a body that arrives whole goes the same way, so that the
        deltas don't depend on how the text was split (even for a call that then fails)."""
        if not self._log.named and (name := head_name(body)) is not None:
            self._log.name(out, name)
