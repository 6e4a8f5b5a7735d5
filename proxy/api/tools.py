"""A chat request's tools: `tools`, `tool_choice`, `parallel_tool_calls`, read as vLLM reads them, and the
constraint each choice puts on the output.

- `none` (the default without tools): the model answers with text; the tools are still shown to it.
- `required` and a named function: the nodes constrain the output to JSON of the call(s) (the structured-output
  path), so the arguments validate against the tool's schema whatever the model: a named function's output is its
  arguments object; `required`'s is a list of {"name", "parameters"} (one item when parallel_tool_calls is false).
- `auto` (the default with tools): the model decides; needs `--enable-auto-tool-choice` and a `--tool-call-parser`
  (vLLM's flags), which finds the calls in the text. Where the format's arguments are JSON, the nodes constrain
  every call the model opens to one of the request's tools (xgrammar structural tags), so even `auto` never
  returns malformed arguments.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from typing import Any

from engine.types import StructuredOutputsParams
from proxy.api.errors import bad_request
from proxy.api.parsers import TOOL_PARSERS
from proxy.api.structured_outputs import checked_json_schema
from settings.chat import ChatSettings

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolChoice(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]  # a JSON schema of the arguments object
    strict: bool = False  # OpenAI's strict mode: no property the schema does not name

    def as_template_input(self) -> dict[str, Any]:
        """As transformers' apply_chat_template(tools=...) takes it (OpenAI's shape)."""
        function: dict[str, Any] = {"name": self.name}  # OpenAI's key order: templates write it as it comes
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": {**function, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolUse:
    """What a chat request asked of its tools."""

    tools: tuple[Tool, ...]
    choice: ToolChoice
    named: str | None  # the function a named choice forces
    parallel: bool  # more than one call per answer

    def tool(self, name: str) -> Tool:
        return next(t for t in self.tools if t.name == name)

    def output_schema(self) -> dict[str, Any] | None:
        """The JSON schema the nodes hold a `required` or named choice's output to; None for none and auto."""
        if self.choice is ToolChoice.NAMED:
            assert self.named is not None, "a named choice names its function"
            return self.tool(self.named).parameters
        if self.choice is not ToolChoice.REQUIRED:
            return None
        calls = [{"type": "object", "properties": {"name": {"const": t.name}, "parameters": t.parameters},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema


NO_TOOLS = ToolUse((), ToolChoice.NONE, None, True)


def parse_tools(body: dict[str, Any]) -> ToolUse:
    """The request's tools and choice; a 400 naming the field for anything malformed."""
    raw_tools = body.get("tools")
    if raw_tools is not None and not isinstance(raw_tools, list):
        raise bad_request("'tools' must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    tools = tuple(_tool(t, i) for i, t in enumerate(raw_tools or []))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools[].function.name must be unique", "tools")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    choice, named = _tool_choice(body.get("tool_choice"), bool(tools))
    if named is not None and named not in names:
        raise bad_request(f"tool_choice names the function '{named[:64]}', which is not in 'tools'", "tool_choice")
    if choice in (ToolChoice.REQUIRED, ToolChoice.NAMED) and not tools:
        raise bad_request(f"tool_choice '{choice.value}' needs 'tools'", "tool_choice")
    return ToolUse(tools, choice, named, parallel)


def _tool(value: Any, index: int) -> Tool:
    where = f"tools[{index}]"
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(value.get("function"), dict):
        raise bad_request(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} (function "
                          "tools are the only kind)", "tools")
    function = value["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(f"{where}.function.name must be 1-64 letters, digits, '_' or '-'", "tools")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.function.description must be a string", "tools")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = dict(_EMPTY_PARAMETERS)
    # a tool's schema is checked as a response_format's is (against its metaschema): one rule for both
    parameters = checked_json_schema(f"{where}.function.parameters", "tools", parameters)
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{where}.function.strict must be a boolean", "tools")
    return Tool(name, description, parameters, bool(strict))


def _tool_choice(value: Any, has_tools: bool) -> tuple[ToolChoice, str | None]:
    if value is None:
        return (ToolChoice.AUTO if has_tools else ToolChoice.NONE), None
    if isinstance(value, str):
        try:
            choice = ToolChoice(value)
        except ValueError:
            choice = ToolChoice.NAMED  # refused below
        if choice is not ToolChoice.NAMED:
            return choice, None
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
        if isinstance(name, str) and name:
            return ToolChoice.NAMED, name
    raise bad_request("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": "
                      "{\"name\": ...}}", "tool_choice")


# ---- auto: the parser, and the calls it may constrain ----

def auto_structural_tag(settings: ChatSettings, use: ToolUse) -> str | None:
    """The structural tag (xgrammar's format, as JSON text) that holds every call the model opens to one of the
    request's tools; None where the format cannot say its arguments as JSON (pythonic) or constraining is off."""
    parser = settings.tool_call_parser
    if settings.unconstrained_auto_tool_calls or parser is None or use.choice is not ToolChoice.AUTO:
        return None
    found = TOOL_PARSERS[parser].structures([(t.name, t.parameters) for t in use.tools])
    if found is None:
        return None
    structures, triggers = found
    # vLLM's (xgrammar's legacy) shape: the nodes compile each schema with the request's JSON options
    return json.dumps({"type": "structural_tag", "triggers": triggers,
                       "structures": [{"begin": s.begin, "schema": s.schema, "end": s.end} for s in structures]})


def tool_constraint(use: ToolUse, settings: ChatSettings, asked: StructuredOutputsParams | None
                    ) -> StructuredOutputsParams | None:
    """What the nodes hold the output to, given the tools and the request's own constraint (`asked`:
    response_format, structured_outputs, guided_*)."""
    schema = use.output_schema()
    if schema is not None:
        if asked is not None:
            raise bad_request(f"tool_choice '{use.choice.value}' makes the answer a tool call: a response_format or "
                              "structured_outputs constraint cannot apply to it", "tool_choice")
        # compact JSON (", " and ": " only): arguments are for a program, and a weak model given free
        # whitespace can fill it until max_tokens. Strict as response_format's strict is: for every tool the
        # answer may call (one strict tool makes them all closed, the one rule xgrammar has per grammar)
        callable_tools = [use.tool(use.named)] if use.named is not None else list(use.tools)
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True,
                                       disable_additional_properties=any(t.strict for t in callable_tools))
    tag = auto_structural_tag(settings, use)
    if tag is None:
        return asked
    if asked is None:
        return StructuredOutputsParams(structural_tag=tag, disable_any_whitespace=True,
                                       disable_additional_properties=any(t.strict for t in use.tools))
    if asked.json is None and not asked.json_object:
        raise bad_request("with tool_choice auto, only a JSON response_format combines with the tools' calls",
                          "response_format")
    # either an answer in the asked JSON, or text with at least one call (xgrammar's own structural-tag format)
    answer = asked.json if asked.json is not None else {"type": "object"}
    if isinstance(answer, str):
        answer = json.loads(answer)
    legacy = json.loads(tag)
    calls = {"type": "triggered_tags", "triggers": legacy["triggers"], "at_least_one": True,
             "tags": [{"type": "tag", "begin": s["begin"], "end": s["end"],
                       "content": {"type": "json_schema", "json_schema": s["schema"]}} for s in legacy["structures"]]}
    either = {"type": "structural_tag", "format": {"type": "or", "elements": [
        {"type": "json_schema", "json_schema": answer}, calls]}}
    return StructuredOutputsParams(structural_tag=json.dumps(either))
