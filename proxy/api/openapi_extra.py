"""The parts of the proxy's OpenAPI document (proxy/api/openapi.py) that describe vLLM's /tokenize and /detokenize
(proxy/api/tokenize.py) and OpenAI's Responses API, stateless (proxy/api/responses_api.py, responses_events.py).

As in openapi.py, each schema says what the parser enforces: the fields it reads, the values it refuses (400 naming
the field), the bounds. Where the two APIs differ on unknown fields, so do the schemas: /tokenize and /detokenize
refuse any field they do not read, /v1/responses only one with a value (null reads as absent, as for its fields).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from proxy.api.openapi_chat import chat_tool_properties
from proxy.api.openapi_parts import Schema, flag, ref

if TYPE_CHECKING:
    from proxy.api.openapi import ServedAPI


LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the one `include` the Responses API takes
RESPONSE_EVENT_TYPES = (
    "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
    "response.output_text.delta", "response.reasoning_text.delta", "response.function_call_arguments.delta",
    "response.output_text.done", "response.reasoning_text.done", "response.function_call_arguments.done",
    "response.content_part.done", "response.output_item.done", "response.completed", "response.incomplete",
    "response.failed")
_NAME_PATTERN = "^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for a function's and a json_schema's name


def _or_null(kind: str, **schema: Any) -> Schema:
    """The proxy reads null as "not given" for every optional field."""
    return {"type": [kind, "null"], **schema}


# ---- /tokenize and /detokenize ----

def tokenizer_schemas(api: ServedAPI, model: Schema) -> dict[str, Schema]:
    """TokenizeRequest (a prompt or a chat), TokenizeResponse, DetokenizeRequest, DetokenizeResponse; `model`: the
    served model's schema, as the generating endpoints have it."""
    token_id = {"type": "integer", "minimum": 0, "maximum": api.vocab_size - 1}
    return_token_strs = flag("token_strs: each token's string (the tokenizer's convert_ids_to_tokens).", False)
    chat = chat_tool_properties()
    prompt_form: Schema = {
        "title": "A prompt", "type": "object", "required": ["prompt"], "additionalProperties": False,
        "properties": {"model": model, "prompt": {"type": "string"},
                       "add_special_tokens": flag("Let the tokenizer add its special tokens (e.g. a BOS).", True),
                       "return_token_strs": return_token_strs}}
    chat_form: Schema = {
        "title": "A chat", "type": "object", "required": ["messages"], "additionalProperties": False,
        "description": "Rendered as /v1/chat/completions renders it (the same template and tools): `count` is its "
                       "usage.prompt_tokens. A chat template may refuse a conversation (400).",
        # continue_final_message needs add_generation_prompt false (absent: it defaults so)
        "not": {"required": ["continue_final_message", "add_generation_prompt"],
                "properties": {"continue_final_message": {"const": True}, "add_generation_prompt": {"const": True}}},
        "properties": {
            "model": model, "messages": {"type": "array", "items": ref("ChatMessage"), "minItems": 1},
            "add_generation_prompt": flag("End with the assistant's turn.", True),
            "continue_final_message": chat["continue_final_message"],
            "tools": {**chat["tools"], "description": "Function tools (names unique), rendered as a chat's; "
                                                      "nothing is constrained (tool_choice none)."},
            "chat_template": {"type": "null", "description": "The served template only: null or absent."},
            "chat_template_kwargs": chat["chat_template_kwargs"],
            "add_special_tokens": flag("The tokenizer's special tokens on top of the template's.", False),
            "return_token_strs": return_token_strs}}
    return {
        "TokenizeRequest": {
            "oneOf": [prompt_form, chat_form],
            "description": "A prompt or a chat, not both. Any other field, null or not: 400 unsupported_parameter.",
            "example": {"model": api.served_model_name, "prompt": "Once upon a time", "return_token_strs": True}},
        "TokenizeResponse": {
            "type": "object", "required": ["count", "max_model_len", "tokens", "token_strs"],
            "properties": {"count": {"type": "integer", "minimum": 0, "description": "The number of tokens."},
                           "max_model_len": {"const": api.max_model_len, "description": "The context's length "
                                                                                         "(null: not known)."},
                           "tokens": {"type": "array", "items": token_id},
                           "token_strs": {"type": ["array", "null"], "items": {"type": "string"},
                                          "description": "With return_token_strs."}}},
        "DetokenizeRequest": {
            "type": "object", "required": ["tokens"], "additionalProperties": False,
            "description": "Any other field, null or not: 400 unsupported_parameter.",
            "properties": {"model": model, "tokens": {"type": "array", "items": token_id,
                                                      "description": "Token ids of the served vocabulary."}},
            "example": {"model": api.served_model_name, "tokens": list(range(min(3, api.vocab_size)))}},
        "DetokenizeResponse": {
            "type": "object", "required": ["prompt"],
            "properties": {"prompt": {"type": "string", "description": "The ids' text, special tokens kept."}}},
    }


# ---- /v1/responses: the request ----

_TEXT: Schema = {"anyOf": [{"type": "string"}, {"type": "array", "items": {
    "type": "object", "required": ["type", "text"],
    "properties": {"type": {"enum": ["input_text", "output_text"]}, "text": {"type": "string"}}}}],
    "description": "A text, or text parts joined (images, files, audio: 400)."}
_NOT_READ: Schema = {"description": "Accepted, not read (what the SDKs send back of an earlier response's output)."}
_INPUT_ITEM: Schema = {"anyOf": [
    {"title": "A message", "type": "object", "required": ["role", "content"], "additionalProperties": False,
     "properties": {"type": {"const": "message", "description": "The default."},
                    "role": {"enum": ["user", "system", "developer", "assistant"]}, "content": _TEXT,
                    "id": _NOT_READ, "status": _NOT_READ, "phase": _NOT_READ}},
    {"title": "A function call (an assistant's; consecutive ones and the message before them make one turn)",
     "type": "object", "required": ["type", "call_id", "name", "arguments"], "additionalProperties": False,
     "properties": {"type": {"const": "function_call"}, "call_id": {"type": "string"}, "name": {"type": "string"},
                    "arguments": {"type": "string", "contentMediaType": "application/json",
                                  "contentSchema": {"type": "object"},
                                  "pattern": r"^([ \t\n\r]*\{[\s\S]*\}[ \t\n\r]*)?$",
                                  "description": "The JSON text of an object, or empty (400 otherwise)."},
                    "id": _NOT_READ, "status": _NOT_READ}},
    {"title": "A function call's output (a tool message)", "type": "object",
     "required": ["type", "call_id", "output"], "additionalProperties": False,
     "properties": {"type": {"const": "function_call_output"}, "call_id": {"type": "string"}, "output": _TEXT,
                    "id": _NOT_READ, "status": _NOT_READ}},
    {"title": "A reasoning item: accepted and not rendered, as a chat drops earlier turns' reasoning",
     "type": "object", "required": ["type"], "properties": {"type": {"const": "reasoning"}}}]}
_FLAT_TOOL: Schema = {
    "type": "object", "required": ["type", "name"], "additionalProperties": False,
    "properties": {"type": {"const": "function", "description": "Function tools only (others: 400)."},
                   "name": {"type": "string", "pattern": _NAME_PATTERN},
                   "description": _or_null("string"),
                   "parameters": _or_null("object", description="A JSON schema of the arguments (valid against "
                                                                "its metaschema)."),
                   "strict": _or_null("boolean")}}
_NAMED_CHOICE: Schema = {"type": "object", "required": ["type", "name"],
                         "properties": {"type": {"const": "function"}, "name": {"type": "string", "minLength": 1}}}
_TEXT_FORMAT: Schema = {
    "type": "object", "required": ["type"], "description": "The constraint chat's response_format makes.",
    "properties": {"type": {"enum": ["text", "json_object", "json_schema"]}},
    # name and schema are read (and must be well formed) only with type json_schema
    "if": {"properties": {"type": {"const": "json_schema"}}},
    "then": {"required": ["name", "schema"],
             "properties": {"name": {"type": "string", "pattern": _NAME_PATTERN}, "description": _or_null("string"),
                            "schema": {"type": "object", "description": "Valid against its metaschema, and "
                                                                        "compiled by xgrammar (400)."},
                            "strict": _or_null("boolean")}}}
_EFFORT: Schema = {"enum": ["none", "minimal", "low", "medium", "high", "xhigh", None]}
_SUMMARY: Schema = {"enum": ["auto", "concise", "detailed", None]}


def responses_request(api: ServedAPI, shared: dict[str, Schema]) -> Schema:
    """ResponseRequest; `shared`: the chat request's schemas of model, temperature, top_p and max tokens (as
    max_output_tokens), which the Responses request goes through."""
    refused = "this server is stateless: null or absent only (400 unsupported_parameter)."
    return {
        "type": "object", "required": ["input"],
        "description": "Served as the chat its input stands for (n = 1). Any other field: null only, read as absent "
                       "(400 unsupported_parameter).",
        "additionalProperties": {"type": "null"},
        "allOf": [
            # top_logprobs needs include ["message.output_text.logprobs"]
            {"if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
             "then": {"required": ["include"], "properties": {"include": {"type": "array", "minItems": 1}}}},
            # a required or named tool choice needs tools
            {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {"anyOf": [
                {"const": "required"}, {"type": "object"}]}}},
             "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}},
            # reasoning items are not rendered: without instructions, the input needs another item
            {"if": {"not": {"required": ["instructions"], "properties": {"instructions": {"type": "string"}}}},
             "then": {"properties": {"input": {"anyOf": [{"type": "string"}, {"type": "array", "contains": {
                 "not": {"required": ["type"], "properties": {"type": {"const": "reasoning"}}}}}]}}}}],
        "properties": {
            "model": shared["model"],
            "input": {"anyOf": [{"type": "string", "description": "One user message."},
                                {"type": "array", "items": _INPUT_ITEM, "minItems": 1}]},
            "instructions": _or_null("string", description="A system message before the input."),
            "tools": _or_null("array", items=_FLAT_TOOL, description="Function tools (names unique). With tools, "
                                                                     "tool_choice defaults to auto."),
            "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required", None]}, _NAMED_CHOICE],
                            "description": "none; auto (needs --enable-auto-tool-choice, else 400); required or a "
                                           "function of tools by name: the answer is a call (text.format is checked "
                                           "and set aside)."},
            "parallel_tool_calls": flag("false: at most one call.", True),
            "max_output_tokens": {**shared["max_output_tokens"],
                                  "description": "Tokens to generate at most; the input's tokens + these must fit "
                                                 "the context (400 context_length_exceeded). Reached: status "
                                                 "incomplete."},
            "temperature": shared["temperature"], "top_p": shared["top_p"],
            "stream": flag("Answer as server-sent events: the Responses API's event types, ending with the "
                            "response's last event (no `data: [DONE]`).", False),
            "reasoning": _or_null("object", additionalProperties=False, description="Checked, and changes nothing: "
                                  "a reasoning model's thinking comes back whole, never summarized.",
                                  properties={"effort": _EFFORT, "summary": _SUMMARY, "generate_summary": _SUMMARY}),
            "text": _or_null("object", additionalProperties=False,
                             properties={"format": {"anyOf": [_TEXT_FORMAT, {"type": "null"}]},
                                         "verbosity": {"type": "null", "description": "Not supported."}}),
            "metadata": _or_null("object", maxProperties=16, propertyNames={"maxLength": 64},
                                 additionalProperties={"type": "string", "maxLength": 512},
                                 description="Echoed in the response."),
            "user": _or_null("string", description="Echoed in the response."),
            "include": _or_null("array", items={"const": LOGPROBS_INCLUDE}),
            "top_logprobs": _or_null("integer", minimum=0, maximum=api.limits.max_logprobs,
                                     description=f"The most likely tokens per position (needs include "
                                                 f"[\"{LOGPROBS_INCLUDE}\"])."),
            "store": {"enum": [False, None], "description": f"Nothing is stored: {refused}"},
            "truncation": {"enum": ["disabled", None], "description": "A conversation longer than the context is "
                                                                      "refused (400), never cut."},
            "background": {"enum": [False, None], "description": f"Not supported: {refused}"},
            "previous_response_id": {"type": "null", "description": f"Send the whole conversation: {refused}"},
            "conversation": {"type": "null", "description": f"Send the whole conversation: {refused}"},
            "prompt": {"type": "null", "description": "Stored prompt templates are not supported."},
        },
        "example": {"model": api.served_model_name, "instructions": "You are terse.", "input": "Say hi.",
                    "max_output_tokens": 8, "temperature": 0.7, "include": [LOGPROBS_INCLUDE], "top_logprobs": 2,
                    "metadata": {"session": "docs"}},
    }


# ---- /v1/responses: the answer ----

_ITEM_STATUS: Schema = {"enum": ["in_progress", "completed", "incomplete"]}
_LOGPROB: Schema = {
    "type": "object", "required": ["token", "logprob", "bytes"],
    "properties": {"token": {"type": "string"}, "logprob": {"type": "number"},
                   "bytes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}}}}
_TOKEN_LOGPROBS: Schema = {"type": "array", "items": {"allOf": [_LOGPROB, {
    "required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "array", "items": _LOGPROB}}}]}}
_OUTPUT_TEXT: Schema = {
    "type": "object", "required": ["type", "text", "annotations"],
    "properties": {"type": {"const": "output_text"}, "text": {"type": "string"},
                   "annotations": {"type": "array", "maxItems": 0},
                   "logprobs": {**_TOKEN_LOGPROBS, "description": f"With include [\"{LOGPROBS_INCLUDE}\"]."}}}
_REASONING_TEXT: Schema = {"type": "object", "required": ["type", "text"],
                           "properties": {"type": {"const": "reasoning_text"}, "text": {"type": "string"}}}


def _item(kind: str, prefix: str, properties: Schema) -> Schema:
    return {"type": "object", "required": ["type", "id", "status", *properties],
            "properties": {"type": {"const": kind}, "id": {"type": "string", "pattern": f"^{prefix}_"},
                           "status": _ITEM_STATUS, **properties}}


def _event(kind: str, **fields: Schema) -> Schema:
    return {"type": "object", "required": ["type", "sequence_number", *fields],
            "properties": {"type": {"const": kind}, "sequence_number": {"type": "integer", "minimum": 0}, **fields}}


def _response_event(kind: str, *statuses: str) -> Schema:
    return _event(kind, response={"allOf": [ref("Response"), {"properties": {"status": {"enum": list(statuses)}}}]})


def responses_schemas() -> dict[str, Schema]:
    """Response, its parts, and ResponseStreamEvent (one event of a stream)."""
    string: Schema = {"type": "string"}
    index: Schema = {"type": "integer", "minimum": 0}
    where: dict[str, Schema] = {"item_id": string, "output_index": index}
    in_part: dict[str, Schema] = {**where, "content_index": {"const": 0}}  # an item has one content part
    logprobs = {"logprobs": _TOKEN_LOGPROBS}  # of the text's tokens: empty unless include asks for them
    return {
        "Response": {
            "type": "object",
            "required": ["id", "object", "created_at", "status", "error", "incomplete_details", "model", "output",
                         "usage", "instructions", "tools", "tool_choice", "parallel_tool_calls", "temperature",
                         "top_p", "max_output_tokens", "top_logprobs", "text", "reasoning", "metadata", "user",
                         "truncation", "store", "background", "previous_response_id"],
            "description": "The request's settings are echoed; output and usage are whole once the status is no "
                           "longer in_progress.",
            "properties": {
                "id": {"type": "string", "pattern": "^resp_"}, "object": {"const": "response"},
                "created_at": {"type": "integer"},
                "status": {"enum": ["in_progress", "completed", "incomplete", "failed"],
                           "description": "incomplete: max_output_tokens reached; failed: a node failed mid-stream."},
                "error": {"anyOf": [{"type": "null"}, {
                    "type": "object", "required": ["code", "message"],
                    "properties": {"code": {"enum": ["rate_limit_exceeded", "invalid_prompt", "server_error"]},
                                   "message": string}}]},
                "incomplete_details": {"anyOf": [{"type": "null"}, {
                    "type": "object", "required": ["reason"],
                    "properties": {"reason": {"const": "max_output_tokens"}}}]},
                "model": string, "output": {"type": "array", "items": ref("ResponseOutputItem")},
                "usage": {"anyOf": [{"type": "null"}, ref("ResponseUsage")]},
                "instructions": {"type": ["string", "null"]},
                "tools": {"type": "array", "items": {"type": "object", "required": ["type", "name"]}},
                "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, _NAMED_CHOICE]},
                "parallel_tool_calls": {"type": "boolean"}, "temperature": {"type": "number"},
                "top_p": {"type": "number"}, "max_output_tokens": {"type": ["integer", "null"]},
                "top_logprobs": {"type": ["integer", "null"]},
                "text": {"type": "object", "required": ["format"], "properties": {"format": _TEXT_FORMAT}},
                "reasoning": {"anyOf": [{"type": "null"}, {
                    "type": "object", "required": ["effort", "summary"],
                    "properties": {"effort": _EFFORT, "summary": _SUMMARY}}]},
                "metadata": {"type": "object", "additionalProperties": string}, "user": {"type": ["string", "null"]},
                "truncation": {"const": "disabled"}, "store": {"const": False}, "background": {"const": False},
                "previous_response_id": {"type": "null"}},
            "allOf": [
                {"if": {"properties": {"status": {"const": "in_progress"}}},
                 "then": {"properties": {"output": {"maxItems": 0}, "usage": {"type": "null"}}},
                 "else": {"properties": {"usage": {"type": "object"}}}},
                {"if": {"properties": {"status": {"const": "incomplete"}}},
                 "then": {"properties": {"incomplete_details": {"type": "object"}}},
                 "else": {"properties": {"incomplete_details": {"type": "null"}}}},
                {"if": {"properties": {"status": {"const": "failed"}}},
                 "then": {"properties": {"error": {"type": "object"}}},
                 "else": {"properties": {"error": {"type": "null"}}}}]},
        "ResponseOutputItem": {"anyOf": [
            _item("reasoning", "rs", {"summary": {"type": "array", "maxItems": 0},
                                      "content": {"type": "array", "items": _REASONING_TEXT, "maxItems": 1}}),
            _item("message", "msg", {"role": {"const": "assistant"},
                                     "content": {"type": "array", "items": _OUTPUT_TEXT, "maxItems": 1}}),
            _item("function_call", "fc", {"call_id": {"type": "string", "pattern": "^call_"}, "name": string,
                                          "arguments": string})],
            "description": "In the order of the text: the reasoning (with --reasoning-parser), the answer's message "
                          "(always one), one function_call per call."},
        "ResponseUsage": {
            "type": "object",
            "required": ["input_tokens", "input_tokens_details", "output_tokens", "output_tokens_details",
                         "total_tokens"],
            "properties": {"input_tokens": index, "output_tokens": index, "total_tokens": index,
                           "input_tokens_details": {"type": "object", "required": ["cached_tokens"],
                                                    "properties": {"cached_tokens": index}},
                           "output_tokens_details": {"type": "object", "required": ["reasoning_tokens"],
                                                     "properties": {"reasoning_tokens": index}}}},
        "ResponseStreamEvent": {"anyOf": [
            _response_event("response.created", "in_progress"), _response_event("response.in_progress", "in_progress"),
            _event("response.output_item.added", output_index=index, item=ref("ResponseOutputItem")),
            _event("response.content_part.added", **in_part, part={"anyOf": [_OUTPUT_TEXT, _REASONING_TEXT]}),
            _event("response.output_text.delta", **in_part, delta=string, **logprobs),
            _event("response.reasoning_text.delta", **in_part, delta=string),
            _event("response.function_call_arguments.delta", **where, delta=string),
            _event("response.output_text.done", **in_part, text=string, **logprobs),
            _event("response.reasoning_text.done", **in_part, text=string),
            _event("response.function_call_arguments.done", **where, arguments=string),
            _event("response.content_part.done", **in_part, part={"anyOf": [_OUTPUT_TEXT, _REASONING_TEXT]}),
            _event("response.output_item.done", output_index=index, item=ref("ResponseOutputItem")),
            _response_event("response.completed", "completed"), _response_event("response.incomplete", "incomplete"),
            _response_event("response.failed", "failed")],
            "description": "One event of a stream, numbered by sequence_number from 0. A stream: response.created, "
                           "response.in_progress; per output item its added events, its deltas and its done events; "
                           "then response.completed, response.incomplete or response.failed, and the stream ends."},
    }


def responses_answer() -> Schema:
    """The 200 of /v1/responses: the Response, or its stream of events."""
    return {
        "description": "The response; with stream: true, server-sent events (`event: <type>`, `data: <the event>`) "
                       "that end with response.completed, response.incomplete or response.failed: no `data: [DONE]`.",
        "content": {"application/json": {"schema": ref("Response")},
                    "text/event-stream": {"schema": {
                        "type": "object", "required": ["event", "data"],
                        "properties": {"event": {"enum": list(RESPONSE_EVENT_TYPES), "description": "The data's type."},
                                       "data": {"type": "string", "contentMediaType": "application/json",
                                                "contentSchema": ref("ResponseStreamEvent")}}}}}}
