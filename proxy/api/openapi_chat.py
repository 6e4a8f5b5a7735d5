"""The parts of the proxy's OpenAPI document (proxy/api/openapi.py) that describe chat's messages, tools and
answers, and every request field the table in proxy/api/fields.py names but openapi.py does not describe in
detail: refused ones with their neutral values, accepted ones as anything."""

from __future__ import annotations

from proxy.api.fields import Endpoint, Support, fields_of
from proxy.api.openapi_parts import Schema, nullable

_TEXT_PARTS: Schema = {"type": "array", "description": "Text parts only (images, audio: 400).",
                       "items": {"type": "object", "required": ["type", "text"],
                                 "properties": {"type": {"type": "string", "const": "text"},
                                                "text": {"type": "string"}}}}
_HISTORY_CALL: Schema = {
    "type": "object", "required": ["function"],
    "properties": {"id": nullable({"type": "string"}), "type": nullable({"type": "string", "const": "function"}),
                   "function": {"type": "object", "required": ["name"], "properties": {
                       "name": {"type": "string"},
                       "arguments": nullable({"type": ["string", "object"],
                                              "description": "The JSON text of an object (or the object)."})}}}}

CHAT_MESSAGE: Schema = {
    "type": "object", "required": ["role"],
    "description": "A tool message needs tool_call_id; only assistant messages carry tool_calls.",
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": nullable({"anyOf": [{"type": "string"}, _TEXT_PARTS], "description": "null reads as empty text."}),
        "name": nullable({"type": "string"}),
        "tool_calls": nullable({"type": "array", "items": _HISTORY_CALL}),
        "tool_call_id": nullable({"type": "string"}),
        "reasoning_content": nullable({"type": "string", "description": "Accepted, not rendered."}),
        "function_call": {"type": "null", "description": "Deprecated by OpenAI: send tool_calls."},
    },
    "allOf": [{"if": {"required": ["role"], "properties": {"role": {"const": "tool"}}},
               "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}}},
              {"if": {"required": ["role"], "properties": {"role": {"not": {"const": "assistant"}}}},
               "then": {"properties": {"tool_calls": {"anyOf": [{"type": "null"},
                                                                {"type": "array", "maxItems": 0}]}}}}],
}

_TOOL: Schema = {
    "type": "object", "required": ["type", "function"],
    "properties": {"type": {"type": "string", "const": "function"},
                   "function": {"type": "object", "required": ["name"], "properties": {
                       "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                       "description": nullable({"type": "string"}),
                       "parameters": nullable({"type": "object", "description": "A JSON schema of the arguments "
                                                                               "(valid against its metaschema)."}),
                       "strict": nullable({"type": "boolean"})}}},
}


def chat_tool_properties() -> dict[str, Schema]:
    return {
        "tools": nullable({"type": "array", "items": _TOOL,
                           "description": "Function tools (names unique). With tools, tool_choice defaults to auto."}),
        "tool_choice": nullable({"description": "none; auto (needs --enable-auto-tool-choice, else 400); required "
                                                "and a named function: the nodes hold the answer to JSON of the call. "
                                                "required and a named function need tools.",
                                 "anyOf": [{"type": "string", "enum": ["none", "auto", "required"]},
                                           {"type": "object", "required": ["type", "function"], "properties": {
                                               "type": {"const": "function"},
                                               "function": {"type": "object", "required": ["name"],
                                                            "properties": {"name": {"type": "string",
                                                                                    "minLength": 1}}}}}]}),
        "parallel_tool_calls": nullable({"type": "boolean", "default": True}),
        "chat_template_kwargs": nullable({"type": "object", "description": "To the chat template, e.g. "
                                                                           "{\"enable_thinking\": false}."}),
        "continue_final_message": nullable({"type": "boolean", "default": False,
                                            "description": "Continue the last (assistant) message: then "
                                                           "add_generation_prompt must be false."}),
    }


_ANSWER_CALL: Schema = {
    "type": "object", "required": ["id", "type", "function"],
    "properties": {"id": {"type": "string", "pattern": "^call_"}, "type": {"const": "function"},
                   "function": {"type": "object", "required": ["name", "arguments"],
                                "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}}}
_CALL_PIECE: Schema = {
    "type": "object", "required": ["index"],
    "description": "A call's first piece has id, type and name; later ones an arguments fragment.",
    "properties": {"index": {"type": "integer", "minimum": 0}, "id": {"type": "string"}, "type": {"const": "function"},
                   "function": {"type": "object", "properties": {"name": {"type": "string"},
                                                                 "arguments": {"type": "string"}}}}}

ANSWER_MESSAGE: Schema = {
    "type": "object", "required": ["role", "content"],
    "properties": {"role": {"type": "string", "const": "assistant"},
                   "content": {"type": ["string", "null"], "description": "null when only tools are called."},
                   "reasoning_content": {"type": "string", "description": "With --reasoning-parser."},
                   "tool_calls": {"type": "array", "items": _ANSWER_CALL}, "refusal": {"type": "null"}}}
ANSWER_DELTA: Schema = {
    "type": "object",
    "properties": {"role": {"type": "string", "const": "assistant"}, "content": {"type": "string"},
                   "reasoning_content": {"type": "string"}, "tool_calls": {"type": "array", "items": _CALL_PIECE}}}


def table_properties(endpoint: Endpoint, described: dict[str, Schema]) -> dict[str, Schema]:
    """Every field of the table for `endpoint`: `described` as given, the others from their row."""
    properties = {}
    for name, field in fields_of(endpoint).items():
        if name in described:
            properties[name] = described[name]
        elif field.support is Support.REFUSED:
            properties[name] = {"enum": [None, *field.neutral],
                                "description": f"Not supported ({field.note}): absent, null or a neutral value "
                                               "only (400 unsupported_parameter otherwise)."}
        elif field.support is Support.ACCEPTED:
            properties[name] = {"description": f"Accepted, no effect: {field.note}."}
        else:
            raise AssertionError(f"{endpoint.value}.{name} is honoured: openapi.py must describe it")
    unknown = sorted(set(described) - set(properties))
    assert not unknown, f"described but not in the table of {endpoint.value}: {unknown}"
    return properties
