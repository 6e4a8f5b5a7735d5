"""What a model's raw output text becomes: `content`, `reasoning` (what it thought), and tool calls.

Parsers are incremental: the output processor feeds each choice's new text as it is detokenized, and a parser
answers with what that text added, holding back any tail that may still turn out to open a tool call or close a
reasoning block. Feeding a text whole or split at any point gives the same result: the tests split every format
at every character.

A parser keeps one choice's state: make one per choice (`new_tool_parser`, `new_reasoning_parser`).
"""

from __future__ import annotations

import json
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of one tool call: the call's first piece carries its name, later pieces extend its arguments (the
    JSON text of an object), as OpenAI streams them. Concatenated, a call's `arguments` pieces are valid JSON."""

    index: int  # the call's position among this choice's calls: 0, 1, ...
    name: str | None  # on the call's first piece only
    arguments: str  # a fragment of the arguments' JSON text ("" is allowed)


@dataclass(frozen=True)
class ToolCall:
    """A whole tool call."""

    name: str
    arguments: str  # the JSON text of an object


@dataclass
class ParsedText:
    """What a piece of output text added."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def __add__(self, later: ParsedText) -> ParsedText:
        return ParsedText(self.content + later.content, self.reasoning + later.reasoning,
                          self.tool_calls + later.tool_calls)


@dataclass(frozen=True)
class ToolStructure:
    """How one tool's call looks in a format: `begin` text, then the arguments as JSON that validates against
    `schema`, then `end`. The nodes constrain a call to this once the model writes one of the format's triggers
    (xgrammar's structural tags)."""

    begin: str
    schema: dict[str, Any]
    end: str


class ToolParser(ABC):
    """Finds tool calls in one choice's output (vLLM's `--tool-call-parser NAME`)."""

    name: ClassVar[str]

    @abstractmethod
    def feed(self, text: str) -> ParsedText:
        """The content and tool-call pieces that `text` (the next piece of output) completes."""

    @abstractmethod
    def finish(self) -> ParsedText:
        """The output ended: flush what was held back. A call left unfinished is returned as content."""

    @abstractmethod
    def calls(self) -> list[ToolCall]:
        """The whole calls found so far."""

    @classmethod
    def structures(cls, tools: Sequence[tuple[str, dict[str, Any]]]) -> tuple[list[ToolStructure], list[str]] | None:
        """For constrained `auto` tool choice: one structure per (tool name, parameters schema) and the triggers
        (texts that open a call); None where the format's arguments are not JSON (pythonic)."""
        return None


class SteppedParser:
    """The loop every parser here runs: `feed` adds to the buffer and takes steps until one needs more text;
    `finish` takes the last steps (final: nothing more comes), then `_ended` says what the unfinished rest is."""

    _buf: str

    def feed(self, text: str) -> ParsedText:
        out = ParsedText()
        self._buf += text
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> ParsedText:
        out = ParsedText()
        while self._step(out, final=True):
            pass
        self._ended(out)
        return out

    def _step(self, out: ParsedText, final: bool) -> bool:
        """Consumes what it can of the buffer into `out`; False when it needs more text (or, final, is done)."""
        raise NotImplementedError

    def _ended(self, out: ParsedText) -> None:
        """After the last step: flush what is held."""

    def _content_before(self, out: ParsedText, segments: Segments, trigger: str, final: bool) -> int | None:
        """Releases the buffer's content before `trigger` and returns where the trigger starts; None when there is
        none yet (then all is released but a tail that may still begin it, all of it when final)."""
        at = self._buf.find(trigger)
        if at < 0:
            release = len(self._buf) - (0 if final else held_prefix(self._buf, trigger))
            out.content += segments.add(self._buf[:release])
            self._buf = self._buf[release:]
            return None
        out.content += segments.add(self._buf[:at])
        return at


class ReasoningParser(ABC):
    """Splits one choice's output into reasoning and content (vLLM's `--reasoning-parser NAME`)."""

    name: ClassVar[str]

    def __init__(self, prompt_tail: str = "") -> None:
        """`prompt_tail`: the end of the rendered prompt, where a chat template may already have opened (or opened
        and closed) the reasoning block the output continues."""
        self.prompt_tail = prompt_tail

    @abstractmethod
    def feed(self, text: str) -> ParsedText:
        """The reasoning and content that `text` completes (tool_calls stay empty)."""

    @abstractmethod
    def finish(self) -> ParsedText:
        """The output ended: flush what was held back."""


# --- What the parsers share -------------------------------------------------------------------------------------


def held_prefix(text: str, *tokens: str) -> int:
    """How many characters at the end of `text` may still grow into one of `tokens` (the longest proper prefix of a
    token that `text` ends with): the parsers hold that tail back until the next piece decides it."""
    held = 0
    for token in tokens:
        for n in range(min(len(text), len(token) - 1), held, -1):
            if text.endswith(token[:n]):
                held = n
                break
    return held


def starts_token(text: str, token: str) -> bool | None:
    """Whether `text` begins with `token`: True, False, or None while `text` is a proper prefix of it (undecided)."""
    if text.startswith(token):
        return True
    return None if token.startswith(text) else False


class JsonExtent:
    """Where one JSON object or array ends, its text fed a piece at a time. It only follows brackets and strings
    (brackets inside strings don't count); json.loads judges the text once its brackets close."""

    def __init__(self) -> None:
        self._closers: list[str] = []
        self._in_string = False
        self._escaped = False
        self._pos = 0  # the next character of the value's text to look at: each character is looked at once
        self.broken = False  # a closing bracket that does not match: the text is not JSON

    def scan(self, text: str) -> int | None:
        """`text`: the value's text so far, from its first bracket. The end of the value (exclusive) once its
        brackets close, or the position just past a mismatched bracket (`broken`); None while it is still open."""
        for i in range(self._pos, len(text)):
            char = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._closers.append("}" if char == "{" else "]")
            elif char in "}]":
                if not self._closers or self._closers.pop() != char:
                    self.broken = True
                    return i + 1
                if not self._closers:
                    return i + 1
        self._pos = len(text)
        return None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads_json(text: str) -> Any:
    """json.loads, refusing NaN and Infinity (Python reads them, JSON has no such values); ValueError if not JSON."""
    return json.loads(text, parse_constant=_no_constant)


def arguments_json(value: Any) -> str | None:
    """A call's arguments as the JSON text of an object (json.dumps' spacing, as vLLM sends them), or None where
    they are no object. Lenient as vLLM is: a JSON string holding an object is decoded; null or "" is {}."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return "{}"
    if isinstance(value, str):
        try:
            value = loads_json(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def call_from_json(obj: Any, *, arguments_required: bool) -> ToolCall | None:
    """A ToolCall from a decoded `{"name": ..., "arguments" (or "parameters"): {...}}`; None if it is not one.
    `arguments_required`: where a bare JSON answer could look like a call (llama3_json), a call must say its
    arguments; inside a format's own call markers a missing "arguments" is {} (vLLM's mistral parser does so)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = "arguments" if "arguments" in obj else "parameters"
    if key not in obj and arguments_required:
        return None
    arguments = arguments_json(obj.get(key))
    return None if arguments is None else ToolCall(obj["name"], arguments)


# The start of a call object whose name comes first, as every format's template writes it: the name is known (and
# sent) before the arguments have been written.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:')


def head_name(text: str) -> str | None:
    """The name of the call whose JSON text `text` begins, once its name and the arguments' key are written."""
    match = _CALL_HEAD.match(text)
    if match is None:
        return None
    try:
        name = loads_json(match.group(1))
    except ValueError:
        return None
    return name if isinstance(name, str) and name else None


def finite_json(value: Any) -> Any:
    """`value` (a Python literal) as JSON data: tuples become lists; ValueError for what JSON cannot say (sets,
    bytes, complex numbers, NaN and infinities, keys that are not strings)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("not a finite number")
        return value
    if isinstance(value, list | tuple):
        return [finite_json(item) for item in value]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {key: finite_json(item) for key, item in value.items()}
    raise ValueError(f"{type(value).__name__} is not JSON")


class CallLog:
    """The calls one choice made, and the deltas that announce them: a call's index is fixed when its first delta
    goes out (its name), so a call that fails after its name was sent keeps its index and the next call takes the
    next one (a client already holds that index)."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._index = 0
        self._named: str | None = None  # the name sent for the call now open

    @property
    def named(self) -> bool:
        return self._named is not None

    def name(self, out: ParsedText, name: str) -> None:
        """Send the open call's name (once)."""
        if self._named is None:
            self._named = name
            out.tool_calls.append(ToolCallDelta(self._index, name, ""))

    def accept(self, out: ParsedText, call: ToolCall) -> bool:
        """The open call is whole: send its arguments (and its name, if not sent). False, dropping it, where the
        name already sent is not the call's."""
        if self._named is not None and self._named != call.name:
            self.drop()
            return False
        out.tool_calls.append(ToolCallDelta(self._index, None if self._named else call.name, call.arguments))
        self.calls.append(call)
        self._index += 1
        self._named = None
        return True

    def drop(self) -> None:
        """The open call turned out not to be one."""
        if self._named is not None:
            self._index += 1
            self._named = None


class Segments:
    """Content around calls. vLLM's parsers keep the text before a call; a piece that is only whitespace next to a
    call (the newline between two calls, after the last one) is dropped, so a client sees no "\\n" content."""

    def __init__(self) -> None:
        self._space = ""  # the whitespace a piece began with, held until the piece turns out to have text
        self._text = False  # the current piece has more than whitespace: it all goes out as it comes

    def add(self, text: str) -> str:
        """The content `text` releases."""
        if self._text or not text:
            return text
        if not text.strip():
            self._space += text
            return ""
        self._text = True
        text, self._space = self._space + text, ""
        return text

    def call_opened(self) -> str:
        """A call begins: the whitespace held before it, dropped unless the call fails (then it goes out)."""
        space, self._space, self._text = self._space, "", False
        return space

    def call_closed(self) -> None:
        """A call ended: a new piece of content begins."""
        self._space, self._text = "", False

    def flush(self, had_calls: bool) -> str:
        """The output ended: held whitespace goes out only where the output made no call (it is the answer)."""
        space, self._space = self._space, ""
        return "" if had_calls else space
