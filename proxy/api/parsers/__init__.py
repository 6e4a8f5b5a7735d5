"""Tool-call and reasoning parsers, by vLLM's names (`--tool-call-parser`, `--reasoning-parser`). Torch-free: the
proxy runs them on the detokenized text of each choice (base.py says how)."""

from __future__ import annotations

from proxy.api.parsers.base import (
    ParsedText,
    ReasoningParser,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStructure,
)
from proxy.api.parsers.hermes import HermesToolParser
from proxy.api.parsers.llama3_json import Llama3JsonToolParser
from proxy.api.parsers.mistral import MistralToolParser
from proxy.api.parsers.pythonic import PythonicToolParser
from proxy.api.parsers.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def new_tool_parser(name: str) -> ToolParser:
    """A parser for one choice's output."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}: known are {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


def new_reasoning_parser(name: str, prompt_tail: str) -> ReasoningParser:
    """A parser for one choice's output; `prompt_tail`: the end of the rendered prompt (see reasoning.py)."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}: known are {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name](prompt_tail)


__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ParsedText",
    "ReasoningParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolStructure",
    "new_reasoning_parser",
    "new_tool_parser",
]
