"""/v1/responses, stateless: OpenAI's Responses API, translated into a chat and served as one.

A request's fields become the chat body that /v1/chat/completions takes, and go through the same parser and
preparation (proxy/api/openai_api.py, proxy/api/prepare.py), so one rule serves both endpoints:
- `input`: a string (one user message) or a list of items: messages (role user, system, developer or assistant; content
  a string or input_text / output_text parts), function_call items (an assistant's tool calls: consecutive ones and
  the assistant message before them make one turn), function_call_output items (tool messages), and reasoning items
  (accepted and not rendered, as a chat drops earlier turns' reasoning). `instructions` is a system message first.
- `tools`: flat function tools {"type": "function", "name", "description", "parameters", "strict"};
  `tool_choice`: none, auto, required or {"type": "function", "name"}; `parallel_tool_calls`.
- `max_output_tokens`, `temperature`, `top_p`, `stream`; `text.format` (text, json_object, json_schema): the
  constraint chat's `response_format` makes, on a text answer (with tool_choice required or a named function the
  answer is a call, and the format is checked and set aside); `top_logprobs` with include
  ["message.output_text.logprobs"].
- `reasoning` ({"effort", "summary"}) is accepted and checked, and changes nothing: no served template reads an
  effort (send a model's own switch, e.g. enable_thinking, through /v1/chat/completions' chat_template_kwargs), and a
  reasoning model's thinking (split by --reasoning-parser) always comes back whole, as a reasoning item's
  reasoning_text content, never summarized (its `summary` is []).
- `metadata`, `user`: echoed in the response. `store`: false or absent. `truncation`: "disabled" or absent.

Refused (400 naming the field): store: true, previous_response_id and conversation (nothing is stored), background,
truncation "auto", tool types other than function, non-text content parts, and any field not listed above.
"""

from __future__ import annotations

import dataclasses
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from proxy.api.errors import APIError, bad_request
from proxy.api.openai_api import parse_chat
from proxy.api.prepare import PreparedChat, check_length, prepare_parsed_chat
from proxy.api.request_body import decode_json
from proxy.api.responses import ChoiceDelta
from proxy.api.responses_events import ResponseEcho, ResponseOutput, sse_event
from proxy.api.serving import ProxyState, fan_out, generate
from proxy.api.tools import ToolChoice

_FIELDS = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
    "temperature", "top_p", "stream", "reasoning", "text", "metadata", "user", "store", "include", "truncation",
    "top_logprobs"})
_STATELESS = "this server is stateless: nothing is stored, send the whole conversation in 'input'"
_REFUSED = {"previous_response_id": _STATELESS, "conversation": _STATELESS,
            "background": "background responses need a stored response to poll; this server is stateless",
            "prompt": "stored prompt templates are not supported; send 'instructions' and 'input'"}
_LOGPROBS = "message.output_text.logprobs"
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")
# the keys each input item may have: what the SDKs send back of an earlier response's output
_ITEM_KEYS = {"message": {"type", "role", "content", "id", "status", "phase"},
              "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
              "function_call_output": {"type", "call_id", "output", "id", "status"}}
_TOOL_KEYS = ("type", "name", "description", "parameters", "strict")
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_SUMMARIES = ("auto", "concise", "detailed")
# chat's names in its errors -> the Responses request's
_RENAMED = (("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
            ("response_format.json_schema", "text.format"), ("response_format", "text.format"), ("].function.", "]."))
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text"}


@dataclass(frozen=True)
class PreparedResponse:
    chat: PreparedChat  # the request as a chat, ready to generate (n=1)
    echo: ResponseEcho  # the settings the response object repeats


def prepare_response(state: ProxyState, body: bytes) -> PreparedResponse:
    """A /v1/responses body made ready to generate, on a tokenizer thread; APIError for anything malformed."""
    raw = decode_json(body)
    if not isinstance(raw, dict):
        raise bad_request("the request body must be a JSON object")
    chat_body, origins, echo = translate(raw)
    try:
        chat = parse_chat(chat_body, state.limits)
        if chat.tools.choice in (ToolChoice.REQUIRED, ToolChoice.NAMED):
            # text.format holds a text answer, and a forced call leaves none: checked, then set aside (OpenAI's
            # meaning; an agent forces its first call and keeps its output type for its last answer)
            params = dataclasses.replace(chat.generation.params, structured_outputs=None)
            chat = dataclasses.replace(chat, generation=dataclasses.replace(chat.generation, params=params))
        return PreparedResponse(prepare_parsed_chat(state, chat), echo)
    except APIError as e:
        raise _renamed(e, origins) from None


class ResponseRun:
    """One response's generation, collected whole (`whole`) or streamed (`first`, then `events`). Made on the event
    loop; a prompt longer than the context is refused here (400)."""

    def __init__(self, state: ProxyState, prepared: PreparedResponse, arrival: float) -> None:
        chat = prepared.chat
        params = chat.generation.params
        check_length(state.max_model_len, [chat.prompt_ids], params.max_tokens, "input")
        response_id = f"resp_{uuid.uuid4().hex}"
        self.stream = chat.generation.stream
        self.output = ResponseOutput(response_id, state.served_model_name, int(time.time()), prepared.echo,
                                     len(chat.prompt_ids))
        self.deltas = generate(state, response_id, fan_out([chat.prompt_ids], params), arrival, chat.parsing)

    async def whole(self) -> dict[str, Any]:
        """The response object, once the choice has ended; an error ends it as an APIError."""
        try:
            async for delta in self.deltas:
                self.output.feed(delta)
        finally:
            await self.deltas.aclose()  # cancelled (the client left): this aborts the choice on the nodes
        final: dict[str, Any] = self.output.closing()[-1]["response"]  # response.completed's or .incomplete's
        return final

    async def first(self) -> ChoiceDelta:
        """The first delta: a stream starts once it is there, so errors before it keep their HTTP status."""
        return await anext(self.deltas)

    async def events(self, first: ChoiceDelta) -> AsyncIterator[str]:
        """The stream's server-sent events; an error after the first delta ends it with response.failed."""
        try:
            for event in [*self.output.opening(), *self.output.feed(first)]:
                yield sse_event(event)
            async for delta in self.deltas:
                for event in self.output.feed(delta):
                    yield sse_event(event)
            for event in self.output.closing():
                yield sse_event(event)
        except APIError as e:
            for event in self.output.failed(e):
                yield sse_event(event)
        finally:
            await self.deltas.aclose()  # the client went away: this aborts the choice on the nodes


def translate(body: dict[str, Any]) -> tuple[dict[str, Any], list[str], ResponseEcho]:
    """The chat body a Responses request stands for; where each of its messages came from (`input[i]`,
    `instructions`), for errors; and the settings the response repeats."""
    _refuse_unsupported(body)
    messages, origins = _messages(body.get("input"), _optional(body, "instructions", str))
    raw_tools = _optional(body, "tools", list) or []
    tools = [_chat_tool(tool, i) for i, tool in enumerate(raw_tools)]
    text = _optional(body, "text", dict) or {}
    include = _include(body)
    chat: dict[str, Any] = {
        "model": body.get("model"), "messages": messages, "tools": tools or None,
        "tool_choice": _chat_tool_choice(body.get("tool_choice")),
        "parallel_tool_calls": body.get("parallel_tool_calls"),
        "max_completion_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature"),
        "top_p": body.get("top_p"), "stream": body.get("stream"), "response_format": _response_format(text)}
    if _LOGPROBS in include:
        chat.update(logprobs=True, top_logprobs=body.get("top_logprobs"))
    elif body.get("top_logprobs") is not None:
        raise bad_request(f"'top_logprobs' needs include [\"{_LOGPROBS}\"]", "top_logprobs")
    echo = ResponseEcho(
        instructions=body.get("instructions"), tools=[{k: t[k] for k in _TOOL_KEYS if k in t} for t in raw_tools],
        tool_choice=body.get("tool_choice") or ("auto" if tools else "none"),
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
        temperature=_number_or(body.get("temperature"), 1.0), top_p=_number_or(body.get("top_p"), 1.0),
        max_output_tokens=body.get("max_output_tokens"), top_logprobs=body.get("top_logprobs"),
        text={"format": text.get("format") or {"type": "text"}}, reasoning=_reasoning(body),
        metadata=_metadata(body), user=_optional(body, "user", str), with_logprobs=_LOGPROBS in include)
    return chat, origins, echo


def _refuse_unsupported(body: dict[str, Any]) -> None:
    if body.get("store") is True:
        raise bad_request("store: true is not supported (stateless): send store: false, or leave it out", "store",
                          "unsupported_parameter")
    _optional(body, "store", bool)
    for key, value in body.items():
        if value is None or key in _FIELDS or (key == "background" and value is False):  # null is absent
            continue
        why = _REFUSED.get(key, "it is not supported by this server's /v1/responses")
        raise bad_request(f"'{str(key)[:64]}' is not supported: {why}", str(key)[:64], "unsupported_parameter")
    truncation = _optional(body, "truncation", str)
    if truncation not in (None, "disabled"):
        raise bad_request("truncation 'disabled' is the only one: a conversation longer than the context is refused "
                          "(400), never cut", "truncation", "unsupported_parameter")


def _optional(body: dict[str, Any], key: str, kind: type, where: str | None = None) -> Any:
    value = body.get(key)
    if value is not None and (not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool)):
        raise bad_request(f"'{where or key}' must be {_KIND_NAMES[kind]}", (where or key).split(".")[0].split("[")[0])
    return value


_KIND_NAMES = {str: "a string", list: "a list", dict: "an object", bool: "a boolean"}


def _number_or(value: Any, default: float) -> float:
    # checked by the chat parser, after this: the echo only repeats a valid number
    if not isinstance(value, int | float) or isinstance(value, bool):
        return default
    try:
        return float(value)
    except OverflowError:  # an integer of hundreds of digits: refused by the chat parser
        return default


# ---- input: items to chat messages ----

def _messages(value: Any, instructions: str | None) -> tuple[list[dict[str, Any]], list[str]]:
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
        origins.append("instructions")
    if isinstance(value, str):
        return [*messages, {"role": "user", "content": value}], [*origins, "input"]
    if not isinstance(value, list) or not value:
        raise bad_request("'input' must be a string or a non-empty list of items", "input")
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "reasoning":
            continue  # an earlier turn's thinking: not rendered, as a chat drops it
        if not isinstance(kind, str) or kind not in _ITEM_KEYS:  # a list or an object as type: no dict key
            why = " (nothing is stored: send the item itself)" if kind == "item_reference" else ""
            raise bad_request(f"{where}: items of type {str(kind)[:40]!r} are not supported{why}; message, "
                              "function_call, function_call_output and reasoning items are", "input")
        unknown = sorted(str(k) for k in item if k not in _ITEM_KEYS[kind])
        if unknown:
            raise bad_request(f"{where}.{unknown[0][:40]} is not a field of a {kind} item", "input")
        before = len(messages)
        _add_item(messages, kind, item, where)
        origins += [where] * (len(messages) - before)
    return messages, origins


def _add_item(messages: list[dict[str, Any]], kind: str, item: dict[str, Any], where: str) -> None:
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(_ROLES)}", "input")
        messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        return
    if kind == "function_call_output":
        call_id = _optional(item, "call_id", str, f"{where}.call_id")
        if call_id is None:
            raise bad_request(f"{where}.call_id (the call this output answers) is required", "input")
        messages.append({"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output"),
                                                                                  f"{where}.output")})
        return
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise bad_request(f"{where}.{key} must be a string", "input")
    call = {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}
    # one assistant turn: its text, then its calls
    if messages and messages[-1]["role"] == "assistant":
        messages[-1]["tool_calls"] = [*messages[-1].get("tool_calls", []), call]
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{j}]: only text parts ({', '.join(_TEXT_PARTS)} with a 'text') are supported"
                              + (f", got {kind[:40]!r}" if isinstance(kind, str) else ""), "input")
        texts.append(part["text"])
    return "".join(texts)


# ---- tools, tool choice, text format, include, reasoning, metadata ----

def _chat_tool(tool: Any, index: int) -> dict[str, Any]:
    where = f"tools[{index}]"
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise bad_request(f"{where}: tools of type {str(kind)[:40]!r} are not supported; function tools ({{\"type\": "
                          "\"function\", \"name\", \"parameters\"}) are the only kind", "tools",
                          "unsupported_parameter")
    unknown = sorted(str(k) for k in tool if k not in _TOOL_KEYS)
    if unknown:
        raise bad_request(f"{where}.{unknown[0][:40]} is not supported; a function tool's fields are "
                          f"{', '.join(_TOOL_KEYS)}", "tools", "unsupported_parameter")
    return {"type": "function", "function": {k: tool[k] for k in _TOOL_KEYS[1:] if k in tool}}


def _chat_tool_choice(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value  # none, auto, required: the chat parser checks which
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise bad_request("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"name\": ...}"
                      + (f"; {kind[:40]!r} choices are not supported" if isinstance(kind, str) else ""),
                      "tool_choice")


def _response_format(text: dict[str, Any]) -> dict[str, Any] | None:
    unknown = sorted(str(k) for k in text if k not in ("format", "verbosity"))
    if unknown or text.get("verbosity") is not None:
        field = unknown[0][:40] if unknown else "verbosity"
        raise bad_request(f"text.{field} is not supported; text.format is", "text", "unsupported_parameter")
    spec = _optional(text, "format", dict, "text.format")
    if spec is None or spec.get("type") in ("text", "json_object"):
        return spec
    if spec.get("type") != "json_schema":
        raise bad_request("text.format.type must be text, json_object or json_schema", "text")
    # chat's json_schema holds what the Responses format holds flat
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if k != "type"}}


def _include(body: dict[str, Any]) -> list[str]:
    include = _optional(body, "include", list) or []
    for item in include:
        if item != _LOGPROBS:
            raise bad_request(f"include {str(item)[:60]!r} is not supported; only {_LOGPROBS!r} is", "include",
                              "unsupported_parameter")
    return include


def _reasoning(body: dict[str, Any]) -> dict[str, Any] | None:
    reasoning = _optional(body, "reasoning", dict)
    if reasoning is None:
        return None
    allowed = {"effort": _EFFORTS, "summary": _SUMMARIES, "generate_summary": _SUMMARIES}
    for key, value in reasoning.items():
        if key not in allowed:
            raise bad_request(f"reasoning.{str(key)[:40]} is not supported; effort and summary are", "reasoning")
        if value is not None and value not in allowed[key]:
            raise bad_request(f"reasoning.{key} must be one of {', '.join(allowed[key])}", "reasoning")
    return {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")}


def _metadata(body: dict[str, Any]) -> dict[str, str] | None:
    metadata = _optional(body, "metadata", dict)
    if metadata is not None and (len(metadata) > 16 or not all(
            isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in metadata.items())):
        raise bad_request("'metadata' must be at most 16 string values, keys of at most 64 characters and values "
                          "of at most 512", "metadata")
    return metadata


def _renamed(error: APIError, origins: list[str]) -> APIError:
    """A chat parser's error in the Responses request's names: messages[k] is the input item it came from."""
    message = re.sub(r"messages\[(\d+)\]", lambda m: origins[int(m[1])] if int(m[1]) < len(origins) else m[0],
                     error.message)
    message = message.replace("'messages'", "'input'")
    for chat_name, name in _RENAMED:
        message = message.replace(chat_name, name)
    param = _PARAMS.get(error.param, error.param) if error.param is not None else None
    return APIError(error.status, message, param, error.code, error.kind, error.headers)
