"""vLLM's `llama3_json` tool-call format (Llama 3.1/3.2/3.3 and 4 with vLLM's JSON tool templates): the output is
one or more call objects, optionally after `<|python_tag|>`, separated by `; `:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

("arguments" is accepted for "parameters"). As vLLM's streaming parser: the output is calls only where it starts
with `{` or `<|python_tag|>` (we also let whitespace come first); anything else is content, whole. An output whose
first object is no call (a JSON answer) is content, whole, as vLLM's non-streaming parser has it; where a later
object is no call, the calls before it stand and the text from the separator on is content.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from proxy.api.parsers.base import (
    CallLog,
    JsonExtent,
    ParsedText,
    SteppedParser,
    ToolCall,
    ToolParser,
    ToolStructure,
    call_from_json,
    head_name,
    loads_json,
    starts_token,
)

PYTHON_TAG = "<|python_tag|>"

# states
_START = "start"  # nothing decided yet
_EXPECT = "expect"  # after <|python_tag|> or a separator: a call object must come
_OBJECT = "object"  # inside a call object
_AFTER = "after"  # after a call: a separator, or the end
_CONTENT = "content"  # the rest is content


def _call(text: str) -> ToolCall | None:
    try:
        obj = loads_json(text)
    except ValueError:
        return None
    return call_from_json(obj, arguments_required=True)


class Llama3JsonToolParser(SteppedParser, ToolParser):
    name = "llama3_json"

    def __init__(self) -> None:
        self._buf = ""  # text not looked at yet (or the open object's text)
        self._pending = ""  # text passed over since the last call (tag, separators): content if no call follows
        self._state = _START
        self._extent = JsonExtent()
        self._log = CallLog()

    def _ended(self, out: ParsedText) -> None:
        rest, self._pending, self._buf = self._pending + self._buf, "", ""
        # only separators are left after calls: nothing to say; else the unfinished text is content
        if not (self._log.calls and self._state in (_EXPECT, _AFTER)):
            out.content += rest

    def calls(self) -> list[ToolCall]:
        return list(self._log.calls)

    @classmethod
    def structures(cls, tools: Sequence[tuple[str, dict[str, Any]]]) -> tuple[list[ToolStructure], list[str]] | None:
        # xgrammar's "llama" structural tag (what vLLM uses for this parser): the template's "parameters" key
        return [ToolStructure(f'{{"name": {json.dumps(name, ensure_ascii=False)}, "parameters": ', schema, "}")
                for name, schema in tools], ['{"name": ']

    def _step(self, out: ParsedText, final: bool) -> bool:
        """One move; False when it needs more text."""
        if self._state == _CONTENT:
            out.content += self._pending + self._buf
            self._pending = self._buf = ""
            return False
        if self._state == _OBJECT:
            return self._object_step(out, final)
        stripped = self._buf.lstrip()
        if not stripped:
            if final and self._state == _START:
                self._state = _CONTENT
                return True
            return False
        space = self._buf[:len(self._buf) - len(stripped)]
        if self._state == _START:
            tagged = starts_token(stripped, PYTHON_TAG)
            if tagged is None and not final:
                return False
            if tagged:
                self._pass(space + PYTHON_TAG)
                self._state = _EXPECT
                return True
        elif self._state == _AFTER and stripped[0] == ";":
            self._pass(space + ";")
            self._state = _EXPECT
            return True
        # a call object opens (we also take one with no separator); anything else is content
        if stripped[0] != "{":
            self._state = _CONTENT
            return True
        self._pass(space)
        self._state, self._extent = _OBJECT, JsonExtent()
        return True

    def _pass(self, text: str) -> None:
        """Move `text` (the head of the buffer) to what was passed over."""
        self._pending += text
        self._buf = self._buf[len(text):]

    def _object_step(self, out: ParsedText, final: bool) -> bool:
        end = self._extent.scan(self._buf)
        # the name goes out once the head is written, also where the object arrives whole (the same deltas
        # however the text was split, even for an object that then fails)
        if not self._log.named and (name := head_name(self._buf)) is not None:
            self._log.name(out, name)
        if end is None:
            if final:
                self._fail()
                return True
            return False
        call = None if self._extent.broken else _call(self._buf[:end])
        if call is None or not self._log.accept(out, call):
            self._fail()
            return True
        self._pending, self._buf = "", self._buf[end:]
        self._state = _AFTER
        return True

    def _fail(self) -> None:
        self._log.drop()
        self._state = _CONTENT
