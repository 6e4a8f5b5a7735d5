"""The proxy's own OpenAPI 3.1 description, served at GET /openapi.json.

Written here as data, not generated: it says what this proxy accepts and answers, with the bounds its validators
(openai_api.py, app.py) enforce, so that a client generator, a fuzzer (tests/integration/test_fuzz_openapi.py) or
a reader sees the same rules the code applies. The numbers come from the same constants the validators use;
tests/unit/test_openapi.py checks the schema's examples and bounds against the real validation.

What JSON Schema cannot say is in the descriptions: a refusal that depends on two fields (prompt + max_tokens
beyond the context, min_tokens > max_tokens, best_of other than n, prompts x n > --max-n) and a model's
chat template refusing a conversation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.types import FinishReason
from proxy.api.fields import Endpoint
from proxy.api.limits import RequestLimits
from proxy.api.openai_api import integer_bounds
from proxy.api.openapi_chat import ANSWER_DELTA, ANSWER_MESSAGE, CHAT_MESSAGE, chat_tool_properties, table_properties
from proxy.api.openapi_extra import responses_answer, responses_request, responses_schemas, tokenizer_schemas
from proxy.api.openapi_parts import Schema, flag, integer, nullable, ref
from proxy.api.structured_outputs import openapi_properties

INT32_MAX = integer_bounds(32)[1]
INT64_MIN, INT64_MAX = integer_bounds(64)
TOKEN_ID_MAX = 2**31 - 1  # stop_token_ids: any token id the wire carries (one beyond the vocabulary never matches)



@dataclass(frozen=True)
class ServedAPI:
    """What the schema says about this proxy in particular."""

    served_model_name: str
    vocab_size: int  # prompt token ids are in [0, vocab_size)
    max_model_len: int | None  # prompt + max_tokens at most this; None: not known to the proxy
    max_request_body_bytes: int
    api_key_required: bool
    limits: RequestLimits = field(default_factory=RequestLimits)  # --max-n, --max-logprobs, --max-tokens-limit
    metrics_need_key: bool = False  # --metrics-require-api-key


def _sampling_properties(api: ServedAPI) -> dict[str, Schema]:
    """What both endpoints share (openai_api._generation)."""
    model = nullable({"type": "string", "enum": [api.served_model_name, ""],
                       "description": "The served model (GET /v1/models); absent or empty means that one. Any other "
                                      "name: 404."})
    stop_text = {"type": "string", "minLength": 1}
    return {
        "model": model,
        "n": integer(1, api.limits.max_n, "Choices per prompt (for completions, prompts x n is at most "
                                           f"{api.limits.max_n}).", 1),
        "best_of": integer(1, api.limits.max_n, "Only equal to n (anything else: 400 unsupported_parameter)."),
        "temperature": nullable({"type": "number", "minimum": 0, "default": 1.0,
                                  "description": "0 (or below 1e-5) samples greedily."}),
        "top_p": nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1.0}),
        "top_k": integer(-1, INT32_MAX, "-1 or 0: disabled.", 0),
        "min_p": nullable({"type": "number", "minimum": 0, "maximum": 1, "default": 0.0}),
        "seed": integer(INT64_MIN, INT64_MAX, "Sample i of n uses seed + i."),
        "presence_penalty": nullable({"type": "number", "minimum": -2, "maximum": 2, "default": 0.0}),
        "frequency_penalty": nullable({"type": "number", "minimum": -2, "maximum": 2, "default": 0.0}),
        "repetition_penalty": nullable({"type": "number", "exclusiveMinimum": 0, "default": 1.0}),
        "min_tokens": integer(0, INT32_MAX, "At most max_tokens.", 0),
        "stop": nullable({"anyOf": [stop_text, {"type": "array", "items": stop_text}],
                           "description": "Stop strings: the text ends before the first one (unless "
                                          "include_stop_str_in_output)."}),
        "stop_token_ids": nullable({"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                "maximum": TOKEN_ID_MAX}}),
        "include_stop_str_in_output": flag("Keep the stop string that ended a choice in its text.", False),
        "ignore_eos": flag("Generate past the end-of-sequence token.", False),
        "skip_special_tokens": flag("Leave special tokens out of the text.", True),
        "stream": flag("Answer as server-sent events (text/event-stream), ending with `data: [DONE]`.", False),
        "stream_options": nullable({"type": "object", "description": "Only with stream: true.",
                                     "additionalProperties": False,
                                     "properties": {"include_usage": flag("A last chunk with the usage.", False),
                                                    "continuous_usage_stats": flag(
                                                        "With include_usage: the usage so far in every chunk.",
                                                        False)}}),
        "logit_bias": nullable({"type": "object", "propertyNames": {"pattern": "^[0-9]{1,9}$"},
                                 "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                                 "description": "Token id (decimal text) -> bias added to its logit before sampling; "
                                                "an id outside the vocabulary: 400 from the nodes."}),
        "prompt_logprobs": integer(0, api.limits.max_logprobs, "vLLM's: each prompt token's logprob and the top-N "
                                                                "at its position (in the choice's prompt_logprobs)."),
        "add_special_tokens": flag("Let the tokenizer add its special tokens (completions: true; chat: false, the "
                                    "template writes them).", True),
        "request_id": {"description": "Accepted, no effect: responses carry the proxy's own id."},
        **openapi_properties(),  # response_format, structured_outputs, guided_*
    }


def _max_tokens(api: ServedAPI, default: int | None) -> Schema:
    # a prompt has at least one token: more than max_model_len - 1 never fits
    highest = INT32_MAX if api.max_model_len is None else min(INT32_MAX, api.max_model_len - 1)
    limit = api.limits.max_tokens  # --max-tokens-limit: the most a request may ask for, and what it gets unasked
    if limit is not None:
        highest = min(highest, limit)
        default = limit if default is None else min(default, limit)
    return integer(1, highest, "Tokens to generate at most; the prompt's tokens + max_tokens must fit the "
                                "context (400 context_length_exceeded)." +
                    ("" if default is not None else " Absent: up to the context."), default)


# stream_options needs stream: true (a cross-field rule JSON Schema can say)
_STREAM_OPTIONS_NEED_STREAM: Schema = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}


def _completion_request(api: ServedAPI) -> Schema:
    token_id = {"type": "integer", "minimum": 0, "maximum": api.vocab_size - 1}
    token_ids = {"type": "array", "items": token_id, "minItems": 1}
    text = {"type": "string", "minLength": 1}
    return {
        "type": "object", "required": ["prompt"], **_STREAM_OPTIONS_NEED_STREAM, "additionalProperties": False,
        "properties": table_properties(Endpoint.COMPLETIONS, {
            "prompt": {"description": "A text, a list of token ids, or a list of either (one choice set each).",
                       "anyOf": [text, {"type": "array", "items": text, "minItems": 1}, token_ids,
                                 {"type": "array", "items": token_ids, "minItems": 1}]},
            "max_tokens": _max_tokens(api, 16),
            "logprobs": integer(0, api.limits.max_logprobs, "Top logprobs per token (legacy format)."),
            "echo": flag("The prompt's text before each choice's (and its logprobs, with logprobs).", False),
            **_sampling_properties(api),
        }),
        "example": {"model": api.served_model_name, "prompt": "Once upon a time", "max_tokens": 8,
                    "temperature": 0.7, "top_p": 0.9, "stop": ["\n"], "logprobs": 2},
    }


def _chat_request(api: ServedAPI) -> Schema:
    return {
        "type": "object", "required": ["messages"], **_STREAM_OPTIONS_NEED_STREAM, "additionalProperties": False,
        # top_logprobs needs logprobs: true
        "dependentSchemas": {"top_logprobs": {"anyOf": [
            {"properties": {"top_logprobs": {"type": "null"}}},
            {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}]}},
        "properties": table_properties(Endpoint.CHAT, {
            "messages": {"type": "array", "items": ref("ChatMessage"), "minItems": 1},
            "max_completion_tokens": _max_tokens(api, None),
            "max_tokens": _max_tokens(api, None),
            "logprobs": flag("Logprobs of each generated token.", False),
            "top_logprobs": integer(0, api.limits.max_logprobs,
                                     "The most likely tokens per position (needs logprobs)."),
            "add_generation_prompt": flag("End the templated prompt with the assistant's turn.", True),
            **chat_tool_properties(),
            **_sampling_properties(api),
        }),
        "example": {"model": api.served_model_name, "max_completion_tokens": 8, "logprobs": True, "top_logprobs": 2,
                    "messages": [{"role": "system", "content": "You are terse."},
                                 {"role": "user", "content": [{"type": "text", "text": "Say hi."}]}]},
    }


_ERROR: Schema = {
    "type": "object", "required": ["error"], "additionalProperties": False,
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "additionalProperties": False,
        "properties": {"message": {"type": "string"},
                       "type": {"type": "string", "examples": ["invalid_request_error", "rate_limit_error",
                                                               "service_unavailable", "server_error"]},
                       "param": {"type": ["string", "null"], "description": "The request field at fault."},
                       "code": {"type": ["string", "null"],
                                "examples": ["context_length_exceeded", "model_not_found", "unsupported_parameter",
                                             "request_too_large", "overloaded", "invalid_api_key"]}}}},
}

_FINISH_REASON: Schema = {"type": ["string", "null"], "enum": [*(str(r) for r in FinishReason), "tool_calls", None]}
_USAGE: Schema = {
    "type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {"prompt_tokens": {"type": "integer", "minimum": 0},
                   "completion_tokens": {"type": "integer", "minimum": 0},
                   "total_tokens": {"type": "integer", "minimum": 0},
                   "prompt_tokens_details": {"type": "object",
                                             "properties": {"cached_tokens": {"type": "integer", "minimum": 0}}}},
}
_LEGACY_LOGPROBS: Schema = {
    "type": ["object", "null"], "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
    "properties": {"tokens": {"type": "array", "items": {"type": "string"}},
                   "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},  # null: echo's first
                   "top_logprobs": {"type": "array", "items": {"type": ["object", "null"],
                                                               "additionalProperties": {"type": "number"}}},
                   "text_offset": {"type": "array", "items": {"type": "integer", "minimum": 0}}},
}
_TOKEN_LOGPROB: Schema = {
    "type": "object", "required": ["token", "logprob", "bytes"],
    "properties": {"token": {"type": "string"}, "logprob": {"type": "number"},
                   "bytes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}}},
}
_CHAT_LOGPROBS: Schema = {
    "type": ["object", "null"], "required": ["content"],
    "properties": {"content": {"type": "array", "items": {
        "allOf": [_TOKEN_LOGPROB, {"type": "object", "required": ["top_logprobs"],
                                   "properties": {"top_logprobs": {"type": "array", "items": _TOKEN_LOGPROB}}}]}},
                   "refusal": {"type": "null"}},
}


def _completion_object(obj: str, choice: Schema) -> Schema:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices"],
            "properties": {"id": {"type": "string"}, "object": {"type": "string", "const": obj},
                           "created": {"type": "integer"}, "model": {"type": "string"},
                           "choices": {"type": "array", "items": choice},
                           "usage": {"anyOf": [ref("Usage"), {"type": "null"}]}}}


def _choice(required: list[str], properties: Schema) -> Schema:
    return {"type": "object", "required": ["index", "finish_reason", *required],
            "properties": {"index": {"type": "integer", "minimum": 0}, "finish_reason": _FINISH_REASON,
                           **properties}}


_COMPLETION_CHOICE = _choice(["text", "logprobs"], {"text": {"type": "string"}, "logprobs": _LEGACY_LOGPROBS})
_CHAT_CHOICE = _choice(["message", "logprobs"], {
    "message": ANSWER_MESSAGE,
    "logprobs": _CHAT_LOGPROBS})
_CHAT_CHUNK_CHOICE = _choice(["delta"], {
    "delta": ANSWER_DELTA,
    "logprobs": _CHAT_LOGPROBS})

_MODEL: Schema = {
    "type": "object", "required": ["id", "object", "created", "owned_by"],
    "properties": {"id": {"type": "string"}, "object": {"type": "string", "const": "model"},
                   "created": {"type": "integer"}, "owned_by": {"type": "string"},
                   "max_model_len": {"type": ["integer", "null"], "minimum": 1}},
}
_PROBE: Schema = {
    "type": "object", "required": ["status"],
    "properties": {"status": {"type": "string", "enum": ["ok", "unavailable"]},
                   "reason": {"type": "string", "description": "Why not ready (unavailable only)."}},
}

_HEALTH: Schema = {
    "type": "object", "required": ["status", "ready_nodes"],
    "properties": {"status": {"type": "string", "enum": ["ok", "degraded", "unavailable"],
                              "description": "degraded: no prefill node is ready (decode nodes prefill alone)."},
                   "ready_nodes": {"type": "object", "required": ["prefill", "decode"],
                                   "properties": {"prefill": {"type": "integer", "minimum": 0},
                                                  "decode": {"type": "integer", "minimum": 0}}}},
}


def _json(schema: Schema, description: str) -> Schema:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error(description: str, retry_after: bool = False) -> Schema:
    response = _json(ref("ErrorResponse"), description)
    if retry_after:
        response["headers"] = {"Retry-After": {"description": "Seconds to wait before retrying.",
                                               "schema": {"type": "string", "pattern": "^[0-9]+$"}}}
    return response


def _event(chunk: str) -> Schema:
    """One server-sent event of a stream (OpenAPI 3.1: an event stream's schema describes each event)."""
    return {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
        {"type": "string", "const": "[DONE]", "description": "The last event."},
        {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [
            ref(chunk), ref("ErrorResponse")]}, "description": "A chunk, or the error that ended the stream."}]}}}


def _generation_responses(api: ServedAPI, whole: str, chunk: str) -> dict[str, Schema]:
    return {
        "200": {"description": "The completion; with stream: true, server-sent events of chunks "
                               f"({chunk}), an error event if a node fails mid-stream, then `data: [DONE]`.",
                "content": {"application/json": {"schema": ref(whole)},
                            "text/event-stream": {"schema": _event(chunk)}}},
        "400": _error("A malformed request: the field at fault is in `param`."),
        **_auth_responses(api),
        "404": _error("Another model than the served one (code model_not_found)."),
        "413": _error(f"A body over {api.max_request_body_bytes} bytes (code request_too_large)."),
        "429": _error("The proxy's or the cluster's capacity is taken (code overloaded).", retry_after=True),
        "500": _error("A defect in the proxy (code internal_error)."),
        "502": _error("A node failed the request."),
        "503": _error("No node can serve now.", retry_after=True),
        "504": _error("The request outlasted its deadline."),
    }


def _auth_responses(api: ServedAPI) -> dict[str, Schema]:
    return {"401": _error("A missing or wrong API key (code invalid_api_key).")} if api.api_key_required else {}


def _tokenizer_responses(api: ServedAPI, answer: str, description: str) -> dict[str, Schema]:
    errors = _generation_responses(api, answer, answer)  # less what a node or the capacity answers
    return {"200": _json(ref(answer), description),
            **{status: errors[status] for status in ("400", "401", "404", "413", "500") if status in errors}}


def _operation(api: ServedAPI, summary: str, responses: dict[str, Schema], guarded: bool,
               body: str | None = None) -> Schema:
    operation: Schema = {"summary": summary, "operationId": summary.lower().replace(" ", "_"),
                         "responses": responses}
    if body is not None:
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref(body)}}}
    if guarded and api.api_key_required:
        operation["security"] = [{"bearer": []}]
    return operation


def openapi_schema(api: ServedAPI) -> Schema:
    """The OpenAPI 3.1 document of a proxy that serves `api`."""
    models = _json(ref("ModelList"), "The served model.")
    sampling = _sampling_properties(api)
    document: Schema = {
        "openapi": "3.1.0",
        "info": {"title": "Tandem proxy", "version": "1",
                 "description": "OpenAI-compatible completions, chat completions and responses (stateless) over "
                                "disaggregated prefill and decode nodes, and vLLM's /tokenize and /detokenize. An "
                                "unknown request field is refused (400), and so is a parameter that cannot be "
                                "honoured (400 unsupported_parameter)."},
        "paths": {
            "/v1/completions": {"post": _operation(
                api, "Create completion", _generation_responses(api, "CompletionResponse", "CompletionResponse"),
                True, "CompletionRequest")},
            "/v1/chat/completions": {"post": _operation(
                api, "Create chat completion",
                _generation_responses(api, "ChatCompletionResponse", "ChatCompletionChunk"), True,
                "ChatCompletionRequest")},
            "/v1/responses": {"post": _operation(
                api, "Create response", {**_generation_responses(api, "Response", "Response"),
                                         "200": responses_answer()}, True, "ResponseRequest")},
            "/tokenize": {"post": _operation(api, "Tokenize", _tokenizer_responses(
                api, "TokenizeResponse", "The token ids of the prompt, or of the chat as templated."), True,
                "TokenizeRequest")},
            "/detokenize": {"post": _operation(api, "Detokenize", _tokenizer_responses(
                api, "DetokenizeResponse", "The text of the token ids."), True, "DetokenizeRequest")},
            "/v1/models": {"get": _operation(api, "List models", {"200": models, **_auth_responses(api)}, True)},
            "/v1/models/{model}": {"get": {
                **_operation(api, "Retrieve model", {
                    "200": _json(ref("Model"), "The served model."), **_auth_responses(api),
                    "404": _error("Not the served model (code model_not_found).")}, True),
                "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]}},
            "/health": {"get": _operation(api, "Health", {
                "200": _json(ref("Health"), "A decode node is ready (status ok, or degraded without prefill)."),
                "503": _json(ref("Health"), "No decode node is ready (status unavailable).")}, False)},
            "/ready": {"get": _operation(api, "Readiness", {
                "200": _json(ref("Probe"), "The registry answers (or nodes are listed statically): the proxy can "
                                            "serve, whatever the number of nodes (see tandem:num_nodes)."),
                "503": _json(ref("Probe"), "The registry does not answer.")}, False)},
            "/live": {"get": _operation(api, "Liveness", {
                "200": _json(ref("Probe"), "The proxy's event loop answers.")}, False)},
            "/metrics": {"get": _operation(api, "Metrics", {"200": {
                "description": "Prometheus text exposition.",
                "content": {"text/plain": {"schema": {"type": "string"}}}},
                **(_auth_responses(api) if api.metrics_need_key else {})}, api.metrics_need_key)},
            "/openapi.json": {"get": _operation(api, "OpenAPI", {
                "200": _json({"type": "object"}, "This document."), **_auth_responses(api)}, True)},
        },
        "components": {"schemas": {
            "CompletionRequest": _completion_request(api), "ChatCompletionRequest": _chat_request(api),
            "ChatMessage": CHAT_MESSAGE, "ErrorResponse": _ERROR, "Usage": _USAGE,
            "CompletionResponse": _completion_object("text_completion", _COMPLETION_CHOICE),
            "ChatCompletionResponse": _completion_object("chat.completion", _CHAT_CHOICE),
            "ChatCompletionChunk": _completion_object("chat.completion.chunk", _CHAT_CHUNK_CHOICE),
            "Model": _MODEL, "ModelList": {"type": "object", "required": ["object", "data"],
                                           "properties": {"object": {"type": "string", "const": "list"},
                                                          "data": {"type": "array", "items": ref("Model")}}},
            "Health": _HEALTH, "Probe": _PROBE,
            "ResponseRequest": responses_request(api, {**{k: sampling[k] for k in ("model", "temperature", "top_p")},
                                                       "max_output_tokens": _max_tokens(api, None)}),
            **responses_schemas(), **tokenizer_schemas(api, sampling["model"]),
        }},
    }
    if api.api_key_required:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return document
