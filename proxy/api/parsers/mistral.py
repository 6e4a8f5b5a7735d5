"""vLLM's `mistral` tool-call format, both generations of Mistral's tokenizers:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]     (before v11)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}                (v11 and later)

vLLM picks the form from the tokenizer's version; we tell them apart by what follows `[TOOL_CALLS]` (`[` opens the
list), so one parser serves both. The v11 form may carry `[CALL_ID]<id>` before `[ARGS]` (passed over), and with
tokenizers that lack `[ARGS]` the arguments follow the name directly (`get_weather{...}`), as vLLM accepts. Text
before the first `[TOOL_CALLS]` is content, as in vLLM; text after a call is content too unless only whitespace
(vLLM counts it into the arguments). A call that does not parse goes out as content (vLLM's v11 path returns it as
a call with the raw text as arguments; we keep to whole JSON objects).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from proxy.api.parsers.base import (
    CallLog,
    JsonExtent,
    ParsedText,
    Segments,
    SteppedParser,
    ToolCall,
    ToolParser,
    ToolStructure,
    arguments_json,
    call_from_json,
    head_name,
    loads_json,
    starts_token,
)

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_NAME = re.compile(r"[\w.\-]*")
_MAX_NAME = 256  # past this a "name" is text that happened to follow [TOOL_CALLS]

# states
_TEXT = "text"  # content, looking for BOT
_OPEN = "open"  # just after BOT: the list form or a name
_NAME_S = "name"  # v11: the name, up to [CALL_ID], [ARGS] or {
_CALL_ID_S = "call_id"  # v11: the id after [CALL_ID], up to [ARGS]
_ARGS_OPEN = "args_open"  # v11: before the arguments' {
_ARGS_S = "args"  # v11: inside the arguments
_ITEM = "item"  # list form: an item's { (or the list's end)
_ITEM_OBJ = "item_obj"  # list form: inside an item
_ITEM_AFTER = "item_after"  # list form: after an item: , or ]


class MistralToolParser(SteppedParser, ToolParser):
    name = "mistral"

    def __init__(self) -> None:
        self._buf = ""  # text not looked at yet (or the open JSON value's text)
        self._pending = ""  # this call's text passed over so far: content again if the call fails
        self._state = _TEXT
        self._name = ""
        self._extent = JsonExtent()
        self._log = CallLog()
        self._segments = Segments()
        self._group_calls = 0  # calls made since the last BOT

    def _ended(self, out: ParsedText) -> None:
        if self._state != _TEXT:  # the output ended inside a call (a list without its `]`: what is left after it)
            rest = self._pending + self._buf
            if not (self._state in (_ITEM, _ITEM_AFTER) and self._group_calls and not rest.strip(" \n\t\r,")):
                self._log.drop()
                out.content += self._segments.add(rest)
            self._pending = self._buf = ""
            self._state = _TEXT
        out.content += self._segments.flush(bool(self._log.calls))

    def calls(self) -> list[ToolCall]:
        return list(self._log.calls)

    @classmethod
    def structures(cls, tools: Sequence[tuple[str, dict[str, Any]]]) -> tuple[list[ToolStructure], list[str]] | None:
        # The v11 form (Mistral Small 3.x, Devstral, Magistral, Ministral 3): [TOOL_CALLS] opens each call.
        return [ToolStructure(f"{BOT}{name}{ARGS}", schema, "") for name, schema in tools], [BOT]

    def _step(self, out: ParsedText, final: bool) -> bool:
        """One move; False when it needs more text."""
        if self._state == _TEXT:
            return self._text_step(out, final)
        if self._state in (_ARGS_S, _ITEM_OBJ):
            return self._value_step(out, final)
        if self._state in (_NAME_S, _CALL_ID_S):
            return self._name_step(out, final)
        stripped = self._buf.lstrip()
        if not stripped:
            return False
        self._pass(len(self._buf) - len(stripped))
        char = stripped[0]
        if self._state == _OPEN and char == "[":
            self._pass(1)
            self._state = _ITEM
        elif self._state == _OPEN:
            self._state, self._name = _NAME_S, ""
        elif self._state == _ITEM_AFTER and char in ",]":
            self._pass(1)
            self._state = _ITEM if char == "," else self._end_group()
        elif char == "{" and self._state in (_ARGS_OPEN, _ITEM):
            self._state = _ARGS_S if self._state == _ARGS_OPEN else _ITEM_OBJ
            self._extent = JsonExtent()
        else:
            self._fail(out, 0)
        return True

    def _text_step(self, out: ParsedText, final: bool) -> bool:
        at = self._content_before(out, self._segments, BOT, final)
        if at is None:
            return False
        self._pending = self._segments.call_opened()
        self._buf = self._buf[at:]
        self._pass(len(BOT))
        self._state, self._group_calls = _OPEN, 0
        return True

    def _name_step(self, out: ParsedText, final: bool) -> bool:
        """v11: `name`, then `[CALL_ID]id` maybe, then `[ARGS]` or straight `{`."""
        match = _NAME.match(self._buf)
        length = match.end() if match else 0
        if length > _MAX_NAME:
            self._fail(out, 0)
            return True
        rest = self._buf[length:]
        if not rest:
            return False
        if self._state == _NAME_S:
            self._name += self._buf[:length]
        self._pass(length)
        if rest[0] == "{" and self._state == _NAME_S and self._name:
            self._log.name(out, self._name)
            self._state = _ARGS_OPEN
            return True
        for token, state in ((ARGS, _ARGS_OPEN), (CALL_ID, _CALL_ID_S)):
            begins = starts_token(rest, token)
            if begins is None and not final:
                return False
            if begins and self._name and (token == ARGS or self._state == _NAME_S):
                self._pass(len(token))
                if state == _ARGS_OPEN:
                    self._log.name(out, self._name)
                self._state = state
                return True
        self._fail(out, 0)
        return True

    def _value_step(self, out: ParsedText, final: bool) -> bool:
        end = self._extent.scan(self._buf)
        # a list item's name goes out once its head is written, also where the item arrives whole (the same
        # deltas however the text was split)
        if self._state == _ITEM_OBJ and not self._log.named and (name := head_name(self._buf)) is not None:
            self._log.name(out, name)
        if end is None:
            if final:
                self._fail(out, len(self._buf))
                return True
            return False
        call = None if self._extent.broken else self._call(self._buf[:end])
        if call is None or not self._log.accept(out, call):
            self._fail(out, end)
            return True
        self._buf = self._buf[end:]
        self._pending = ""
        self._group_calls += 1
        self._state = _ITEM_AFTER if self._state == _ITEM_OBJ else self._end_group()
        return True

    def _call(self, text: str) -> ToolCall | None:
        try:
            obj = loads_json(text)
        except ValueError:
            return None
        if self._state == _ITEM_OBJ:
            return call_from_json(obj, arguments_required=False)
        arguments = arguments_json(obj)
        return None if arguments is None else ToolCall(self._name, arguments)

    def _end_group(self) -> str:
        """The calls after one BOT are over: content again."""
        self._segments.call_closed()
        self._pending = ""
        return _TEXT

    def _pass(self, length: int) -> None:
        self._pending += self._buf[:length]
        self._buf = self._buf[length:]

    def _fail(self, out: ParsedText, length: int) -> None:
        """What was passed over, and the buffer's first `length` characters, are content; the rest is looked at
        again as text (it may hold the next BOT)."""
        self._log.drop()
        self._pass(length)
        out.content += self._segments.add(self._pending)
        self._pending = ""
        self._state = _TEXT
