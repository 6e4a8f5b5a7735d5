"""vLLM's `pythonic` tool-call format (Llama 3.2, Llama 4, ToolACE): the output is a Python list of calls whose
keyword arguments are literals,

    [get_weather(city='Paris', unit='celsius'), get_time(zone=None)]

(Llama 4 may wrap it in `<|python_start|>` ... `<|python_end|>`, which vLLM's llama4_pythonic parser strips; we
do too). As vLLM: the output is calls only where it starts with `[` (we also let whitespace come first); anything
else is content, whole. Arguments are read as `ast.literal_eval` reads them (True/False/None become
true/false/null, tuples lists) and sent as JSON. A call vLLM cannot read (a name with a dot, a value that is no
literal) makes it all content; so do we, except that the calls already made stand and the text from the failed one
on is content. vLLM drops positional arguments silently; we count such a call as failed.
"""

from __future__ import annotations

import ast
import json
import re

from proxy.api.parsers.base import CallLog, ParsedText, SteppedParser, ToolCall, ToolParser, finite_json, starts_token

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
_IDENT = re.compile(r"[A-Za-z_]\w*")
_MAX_NAME = 256

# states
_START = "start"  # nothing decided yet
_LIST = "list"  # after <|python_start|>: the list's [ must come
_ITEM = "item"  # a call's name and ( must come
_CALL = "call"  # inside a call's parentheses
_AFTER = "after"  # after a call: , or ]
_DONE = "done"  # after the list: only <|python_end|> and whitespace may follow
_CONTENT = "content"  # the rest is content


class _PythonExtent:
    """Where a call's parentheses close, its text fed a piece at a time; brackets inside strings (' " ''' \"\"\",
    with backslash escapes) don't count."""

    def __init__(self, start: int) -> None:
        self._pos = start  # the next character to look at (the call's opening parenthesis first)
        self._closers: list[str] = []
        self._quote = ""  # the open string's quote
        self.broken = False

    def scan(self, text: str) -> int | None:
        """The end of the call (exclusive) once its parentheses close, the position past a mismatched bracket
        (`broken`), or None while open (or while a quote's kind needs the next characters)."""
        i = self._pos
        while i < len(text):
            char = text[i]
            if self._quote:
                step = self._string_step(text, i)
                if step == 0:
                    break
                i += step
                continue
            if char in "'\"":
                if len(text) - i < 3:  # ' or ''' : the next two characters tell
                    break
                self._quote = char * 3 if text.startswith(char * 3, i) else char
                i += len(self._quote)
                continue
            if char in "([{":
                self._closers.append({"(": ")", "[": "]", "{": "}"}[char])
            elif char in ")]}":
                if not self._closers or self._closers.pop() != char:
                    self.broken = True
                    return i + 1
                if not self._closers:
                    return i + 1
            i += 1
        self._pos = i
        return None

    def _string_step(self, text: str, i: int) -> int:
        """How far to move inside a string at `i` (0: the next characters are needed to tell)."""
        if text[i] == "\\":
            return 2 if i + 1 < len(text) else 0
        if text.startswith(self._quote, i):
            self._quote, length = "", len(self._quote)
            return length
        if len(self._quote) == 3 and text[i] == self._quote[0] and len(text) - i < 3:
            return 0
        return 1


def _call(text: str) -> ToolCall | None:
    """`name(key=literal, ...)` as a ToolCall; None where it is not one."""
    try:
        node = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            return None
        try:
            arguments[keyword.arg] = finite_json(ast.literal_eval(keyword.value))
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
    return ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False))


class PythonicToolParser(SteppedParser, ToolParser):
    name = "pythonic"

    def __init__(self) -> None:
        self._buf = ""  # text not looked at yet (or the open call's text)
        self._pending = ""  # text passed over since the last call: content if what follows is no call
        self._state = _START
        self._extent = _PythonExtent(0)
        self._log = CallLog()

    def _ended(self, out: ParsedText) -> None:
        rest, self._pending, self._buf = self._pending + self._buf, "", ""
        if self._state != _DONE:  # after the list only whitespace is left; else the unfinished text is content
            self._log.drop()
            out.content += rest

    def calls(self) -> list[ToolCall]:
        return list(self._log.calls)

    def _step(self, out: ParsedText, final: bool) -> bool:
        """One move; False when it needs more text."""
        if self._state == _CONTENT:
            out.content += self._pending + self._buf
            self._pending = self._buf = ""
            return False
        if self._state == _CALL:
            return self._call_step(out, final)
        stripped = self._buf.lstrip()
        if not stripped:
            return False
        self._pass(len(self._buf) - len(stripped))
        if self._state == _ITEM:
            return self._item_step(out, final)
        expected = {_START: (PYTHON_START, "["), _LIST: ("[",), _AFTER: (",", "]"), _DONE: (PYTHON_END,)}
        for token in expected[self._state]:
            begins = starts_token(stripped, token)
            if begins is None and not final:
                return False
            if begins:
                self._pass(len(token))
                self._state = {PYTHON_START: _LIST, "[": _ITEM, ",": _ITEM, "]": _DONE}.get(token, _DONE)
                if self._state == _DONE:  # the list is whole: what follows it stands alone
                    self._pending = ""
                return True
        self._state = _CONTENT
        return True

    def _item_step(self, out: ParsedText, final: bool) -> bool:
        match = _IDENT.match(self._buf)
        length = match.end() if match else 0
        if 0 < length <= _MAX_NAME and length == len(self._buf) and not final:
            return False  # the name may go on
        if not 0 < length <= _MAX_NAME or self._buf[length:length + 1] != "(":
            self._state = _CONTENT
            return True
        self._log.name(out, self._buf[:length])
        self._state, self._extent = _CALL, _PythonExtent(length)
        return True

    def _call_step(self, out: ParsedText, final: bool) -> bool:
        end = self._extent.scan(self._buf)
        if end is None and not final:
            return False
        call = None if end is None or self._extent.broken else _call(self._buf[:end])
        if call is None or not self._log.accept(out, call):
            self._log.drop()
            self._state = _CONTENT
            return True
        self._pending, self._buf = "", self._buf[end:]
        self._state = _AFTER
        return True

    def _pass(self, length: int) -> None:
        self._pending += self._buf[:length]
        self._buf = self._buf[length:]
