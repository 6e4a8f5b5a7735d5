"""One chat choice's text, split as it streams: reasoning first (--reasoning-parser), then tool calls in what
remains (the request's tool choice), then content.

- `required` and a named function: the nodes held the output to JSON (proxy/api/tools.py), so it is read as
  JSON: a named function's output is that call's arguments (streamed as they come, after the name), `required`'s
  a list of {"name", "parameters"} (its calls come when the list is whole).
- `auto`: the server's --tool-call-parser finds the calls in the text.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from proxy.api.parsers import new_reasoning_parser, new_tool_parser
from proxy.api.parsers.base import ParsedText, ReasoningParser, ToolCall, ToolCallDelta, ToolParser
from proxy.api.tools import ToolChoice, ToolUse
from settings.chat import ChatSettings


class NamedCallParser(ToolParser):
    """The whole output is the arguments of one call to `function`."""

    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function
        self.arguments = ""
        self.started = False

    def feed(self, text: str) -> ParsedText:
        if not text:
            return ParsedText()
        first = not self.started
        self.started = True
        self.arguments += text
        return ParsedText(tool_calls=[ToolCallDelta(0, self.function if first else None, text)])

    def finish(self) -> ParsedText:
        if self.started:
            return ParsedText()
        self.started = True  # no output at all: a call with no arguments is still the call the client forced
        self.arguments = "{}"
        return ParsedText(tool_calls=[ToolCallDelta(0, self.function, "{}")])

    def calls(self) -> list[ToolCall]:
        return [ToolCall(self.function, self.arguments)] if self.started else []


class RequiredCallsParser(ToolParser):
    """The whole output is a JSON list of {"name", "parameters"}; its calls come once it is whole. A list cut short
    (max_tokens) is returned as content, as any unfinished call is."""

    name = "required"

    def __init__(self) -> None:
        self.text = ""
        self.found: list[ToolCall] = []

    def feed(self, text: str) -> ParsedText:
        self.text += text
        return ParsedText()

    def finish(self) -> ParsedText:
        try:
            items = json.loads(self.text)
            self.found = [ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                          for item in items]
        except (ValueError, TypeError, KeyError):
            return ParsedText(content=self.text)
        return ParsedText(tool_calls=[ToolCallDelta(i, call.name, call.arguments) for i, call in enumerate(self.found)])

    def calls(self) -> list[ToolCall]:
        return list(self.found)


class ChoiceParser:
    """Reasoning, then tool calls, for one choice."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, parallel: bool = True) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.parallel = parallel  # False: calls after the first are dropped (parallel_tool_calls: false)

    def feed(self, text: str) -> ParsedText:
        return self._tool_stage(self.reasoning.feed(text) if self.reasoning else ParsedText(content=text), False)

    def finish(self) -> ParsedText:
        return self._tool_stage(self.reasoning.finish() if self.reasoning else ParsedText(), True)

    def _tool_stage(self, parsed: ParsedText, last: bool) -> ParsedText:
        if self.tools is None:
            return parsed
        found = self.tools.feed(parsed.content) if parsed.content else ParsedText()
        if last:
            found = found + self.tools.finish()
        calls = found.tool_calls if self.parallel else [c for c in found.tool_calls if c.index == 0]
        return ParsedText(found.content, parsed.reasoning + found.reasoning, calls)

    @property
    def made_calls(self) -> bool:
        return self.tools is not None and bool(self.tools.calls())

    def tool_calls(self) -> list[ToolCall]:
        """The whole calls, as the client receives them."""
        calls = self.tools.calls() if self.tools is not None else []
        return calls if self.parallel else calls[:1]


def choice_parsers(use: ToolUse, settings: ChatSettings, prompt_text: str) -> Callable[[], ChoiceParser] | None:
    """A factory of each choice's parser; None when the text needs no parsing (plain content)."""
    reasoning_parser = settings.reasoning_parser
    if use.choice is ToolChoice.NONE and reasoning_parser is None:
        return None
    prompt_tail = prompt_text[-200:]

    def make() -> ChoiceParser:
        tool_parser: ToolParser | None = None
        if use.choice is ToolChoice.NAMED:
            assert use.named is not None, "a named choice names its function"
            tool_parser = NamedCallParser(use.named)
        elif use.choice is ToolChoice.REQUIRED:
            tool_parser = RequiredCallsParser()
        elif use.choice is ToolChoice.AUTO:
            assert settings.tool_call_parser is not None, "auto tool choice is refused without a parser"
            tool_parser = new_tool_parser(settings.tool_call_parser)
        # a forced call is held to JSON from the first token: the model has no room to reason first
        forced = use.choice in (ToolChoice.NAMED, ToolChoice.REQUIRED)
        reasoning = new_reasoning_parser(reasoning_parser, prompt_tail) if reasoning_parser and not forced else None
        return ChoiceParser(reasoning, tool_parser, use.parallel)

    return make
