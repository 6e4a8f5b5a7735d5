"""A chat request's `messages`, read into what the model's chat template renders.

Accepted: system, developer, user, assistant and tool messages; content as a string or a list of text parts;
an assistant's `tool_calls` (OpenAI's shape, arguments as JSON text) and a tool message's `tool_call_id`. As
transformers' templates expect (and vLLM passes them), a call's arguments reach the template as an object, not
as its JSON text. An assistant message's `reasoning_content` is accepted and not rendered (as OpenAI and vLLM
drop earlier turns' reasoning).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from proxy.api.errors import bad_request

_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class HistoryToolCall:
    id: str
    name: str
    arguments: dict[str, Any]  # decoded from the request's JSON text


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str | None  # None: an assistant message that only calls tools
    name: str | None = None
    tool_calls: tuple[HistoryToolCall, ...] = ()
    tool_call_id: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.content if self.content is not None else ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def parse_messages(value: Any) -> list[ChatMessage]:
    if not isinstance(value, list) or not value:
        raise bad_request("'messages' must be a non-empty list", "messages")
    return [_message(m, i) for i, m in enumerate(value)]


def _message(message: Any, index: int) -> ChatMessage:
    where = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise bad_request(f"{where} must be an object with a string 'role'", "messages")
    role = message["role"]
    if role not in _ROLES:
        raise bad_request(f"{where}.role must be one of {', '.join(_ROLES)}, got {role[:40]!r}", "messages")
    if message.get("function_call") is not None:
        raise bad_request(f"{where}.function_call (deprecated by OpenAI) is not supported; send tool_calls",
                          "messages", "unsupported_parameter")
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_request(f"{where}.name must be a string", "messages")
    tool_calls = _history_calls(message.get("tool_calls"), where) if role == "assistant" else ()
    if role != "assistant" and message.get("tool_calls"):
        raise bad_request(f"{where}.tool_calls: only assistant messages call tools", "messages")
    tool_call_id = message.get("tool_call_id")
    if (role == "tool" or tool_call_id is not None) and not isinstance(tool_call_id, str):
        raise bad_request(f"{where}.tool_call_id (the call a tool result answers) must be a string", "messages")
    reasoning = message.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise bad_request(f"{where}.reasoning_content must be a string", "messages")
    content = _content(message.get("content"), where)
    if content is None and not tool_calls and role != "assistant":
        content = ""
    return ChatMessage(role, content, name, tool_calls, tool_call_id if role == "tool" else None)


def _content(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.content: only text parts are supported", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"{where}.content must be a string or a list of text parts", "messages")


def _history_calls(value: Any, where: str) -> tuple[HistoryToolCall, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad_request(f"{where}.tool_calls must be a list", "messages")
    calls = []
    for i, call in enumerate(value):
        at = f"{where}.tool_calls[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"{at} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                              "\"arguments\"}}}}", "messages")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise bad_request(f"{at}.id must be a string", "messages")
        if call.get("type") not in (None, "function"):
            raise bad_request(f"{at}.type must be \"function\"", "messages")
        # some clients leave a history call's id out: any id renders, none is looked up
        calls.append(HistoryToolCall(call_id or f"call_{i}", function["name"],
                                     _arguments(function.get("arguments"), at)))
    return tuple(calls)


def _arguments(value: Any, at: str) -> dict[str, Any]:
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            decoded = json.loads(value)
        except ValueError:
            decoded = None
        if isinstance(decoded, dict):
            return decoded
    raise bad_request(f"{at}.function.arguments must be the JSON text of an object", "messages")
