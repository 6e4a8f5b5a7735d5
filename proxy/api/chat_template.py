"""A chat rendered through the model's chat template, with its tools, as transformers' apply_chat_template does.

A template that knows tools (Qwen2.5/3, Llama 3.1+, Mistral, Hermes: it reads `tools` and an assistant's
`tool_calls`) renders them itself. One that does not (SmolLM2's, the tiny test models') would drop them silently,
so the model would never learn what it may call; for such a template the proxy falls back, documented in the
README:
- the tools are described in a system message (prepended, or appended to the first system message), with the
  call format of the `hermes` parser: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- an earlier assistant turn's calls are written into its content in that same format.
Whether a template renders tools is found by rendering a probe once per tokenizer.
"""

from __future__ import annotations

import json
from typing import Any

from proxy.api.errors import bad_request

_PROBE_NAME = "tandem_probe_function"
_PROBE_TOOL = {"type": "function", "function": {"name": _PROBE_NAME, "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}
_PROBE_CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_probe", "type": "function", "function": {"name": _PROBE_NAME, "arguments": {}}}]}

FALLBACK_INSTRUCTIONS = (
    "You can call the functions described below. To call one, write a JSON object with its name and arguments "
    "between <tool_call> and </tool_call>, one call per pair of tags, for example:\n"
    '<tool_call>\n{"name": "function_name", "arguments": {"argument": "value"}}\n</tool_call>\n'
    "The functions, one JSON description per line:\n")

# tokenizer id -> (renders tools, renders an assistant's tool calls)
_ABILITIES: dict[int, tuple[bool, bool]] = {}


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                add_generation_prompt: bool, continue_final_message: bool, template_kwargs: dict[str, Any]) -> str:
    """The prompt text; a 400 when the template refuses the conversation."""
    renders_tools, renders_calls = _abilities(tokenizer)
    if not renders_calls:
        messages = [_calls_as_content(m) for m in messages]
    if tools and not renders_tools:
        messages = _with_tool_instructions(messages, tools)
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools if renders_tools else None, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **template_kwargs)
    except Exception as e:  # jinja errors, a tokenizer with no template: the request cannot be served
        raise bad_request(f"cannot apply the model's chat template: {e}"[:500], "messages") from e
    if not isinstance(text, str):
        raise bad_request("the model's chat template did not render text", "messages")
    return text


def _abilities(tokenizer: Any) -> tuple[bool, bool]:
    key = id(tokenizer)
    if key not in _ABILITIES:
        _ABILITIES[key] = (_renders_tools(tokenizer), _renders_calls(tokenizer))
    return _ABILITIES[key]


def _renders_tools(tokenizer: Any) -> bool:
    user = [{"role": "user", "content": "hello"}]
    try:
        with_tools = tokenizer.apply_chat_template(user, tools=[_PROBE_TOOL], tokenize=False)
        without = tokenizer.apply_chat_template(user, tokenize=False)
    except Exception:  # a template that raises on tools cannot render them
        return False
    return bool(with_tools != without and _PROBE_NAME in with_tools)


def _renders_calls(tokenizer: Any) -> bool:
    chat = [{"role": "user", "content": "hello"}, _PROBE_CALL]
    try:
        text = tokenizer.apply_chat_template(chat, tools=[_PROBE_TOOL], tokenize=False)
        without_tools = tokenizer.apply_chat_template([chat[0]], tools=[_PROBE_TOOL], tokenize=False)
    except Exception:
        return False
    return bool(_PROBE_NAME in text[len(without_tools):] or text.count(_PROBE_NAME) > without_tools.count(_PROBE_NAME))


def _calls_as_content(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    written = "".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                    "arguments": c["function"]["arguments"]}, ensure_ascii=False)
                      + "\n</tool_call>" for c in calls)
    content = message.get("content") or ""
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": f"{content}\n{written}" if content else written}


def _with_tool_instructions(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    described = FALLBACK_INSTRUCTIONS + "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    first = messages[0]
    if first.get("role") in ("system", "developer"):
        return [{**first, "content": f"{first.get('content') or ''}\n\n{described}".lstrip()}, *messages[1:]]
    return [{"role": "system", "content": described}, *messages]
