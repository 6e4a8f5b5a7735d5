"""The proxy's OpenAPI document (proxy/api/openapi.py, openapi_extra.py) against the proxy itself: valid JSON Schema,
every route described, its examples served, every documented bound the one the validators enforce (the bound
accepted, one step beyond it refused with a 400 that names the field), and a Responses stream's events as documented.
Requests go through the real app; a scripted pipeline stands in for the nodes."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from starlette.routing import Route

from proxy.api.app import create_app
from proxy.api.auth import APIKeys
from proxy.api.openapi_extra import LOGPROBS_INCLUDE
from proxy.api.serving import ProxyState
from tests.unit.test_openai_api import ScriptedPipeline

MAX_MODEL_LEN = 256
# each POST path: its request's schema and its answer's
ENDPOINTS = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest",
             "/v1/responses": "ResponseRequest", "/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest"}
ANSWERS = {"/v1/completions": "CompletionResponse", "/v1/chat/completions": "ChatCompletionResponse",
           "/v1/responses": "Response", "/tokenize": "TokenizeResponse", "/detokenize": "DetokenizeResponse"}
# a body each probe starts from: one prompt token, so that max_tokens up to max_model_len - 1 fits
BASE_BODIES: dict[str, dict[str, Any]] = {"/v1/completions": {"prompt": [1], "max_tokens": 2},
                                          "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
                                          "/v1/responses": {"input": "hi", "max_output_tokens": 2},
                                          "/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [1]}}
# fields whose refusal beyond a bound names another field (the context check names the prompt) or needs one
ALSO_BLAMED = {"max_tokens": {"prompt", "messages"}, "max_completion_tokens": {"prompt", "messages", "max_tokens"},
               "max_output_tokens": {"input"}, "best_of": {"n"}}
# the bounds of these fields are probed with another that they need
COMPANIONS = {"best_of": lambda v: {"n": v}, "top_logprobs": lambda v: {"logprobs": True}}
RESPONSES_COMPANIONS = {"top_logprobs": lambda v: {"include": [LOGPROBS_INCLUDE]}}
# a completion's max_tokens defaults to 16 and min_tokens must not pass it (cross-field): probed on chat, which
# has no default max_tokens
NOT_PROBED = {("/v1/completions", "min_tokens")}


@pytest.fixture
def state(tokenizer_dir: Path) -> Iterator[ProxyState]:
    from transformers import AutoTokenizer

    state = ProxyState(ScriptedPipeline([5, 6]), AutoTokenizer.from_pretrained(str(tokenizer_dir)), "m",
                       max_model_len=MAX_MODEL_LEN)
    yield state
    state.close()


def served(state: ProxyState, requests: list[tuple[str, str, Any]], headers: list[dict[str, str]] | None = None
           ) -> list[httpx.Response]:
    """The app's answers to (method, path, JSON body) requests, in order."""
    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as http:
            return [await http.request(method, path, json=body, headers=extra)
                    for (method, path, body), extra in zip(requests, headers or [{}] * len(requests), strict=True)]

    return asyncio.run(run())


def document(state: ProxyState) -> dict[str, Any]:
    (response,) = served(state, [("GET", "/openapi.json", None)])
    assert response.status_code == 200
    schema: dict[str, Any] = response.json()
    return schema


def validator(doc: dict[str, Any], component: str) -> jsonschema.Draft202012Validator:
    """A validator of one component schema, its $refs resolved within the document."""
    return jsonschema.Draft202012Validator({**doc, "$ref": f"#/components/schemas/{component}"})


def test_the_document_describes_every_route_with_valid_json_schemas(state: ProxyState) -> None:
    doc = document(state)
    assert doc["openapi"].startswith("3.1")
    for schema in doc["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)
    routes = {r.path.replace("{model:path}", "{model}") for r in create_app(state).routes if isinstance(r, Route)}
    assert set(doc["paths"]) == routes
    models = doc["components"]["schemas"]["CompletionRequest"]["properties"]["model"]
    assert "m" in models["enum"]  # this proxy's served name


def test_the_examples_are_valid_and_served_with_responses_as_documented(state: ProxyState) -> None:
    doc = document(state)
    schemas = doc["components"]["schemas"]
    requests: list[tuple[str, str, Any]] = []
    for path, component in ENDPOINTS.items():
        example = schemas[component]["example"]
        validator(doc, component).validate(example)
        requests.append(("POST", path, example))
    requests += [("GET", "/v1/models", None), ("GET", "/v1/models/m", None), ("GET", "/v1/models/other", None),
                 ("POST", "/v1/completions", {"prompt": "x", "n": 0}), ("POST", "/tokenize", {"prompt": 1})]
    responses = served(state, requests)
    answers = [*ANSWERS.values(), "ModelList", "Model", "ErrorResponse", "ErrorResponse", "ErrorResponse"]
    for response, component in zip(responses, answers, strict=True):
        assert str(response.status_code) in _documented_statuses(doc, response), response.text
        validator(doc, component).validate(response.json())
    completion, _, answer, tokens, text, *_, unknown_model, _, _ = responses
    assert completion.json()["choices"][0]["logprobs"] is not None and unknown_model.status_code == 404
    assert answer.json()["output"][0]["content"][0]["logprobs"], answer.text  # its include asks for them
    assert tokens.json()["token_strs"] is not None and text.status_code == 200


def _documented_statuses(doc: dict[str, Any], response: httpx.Response) -> set[str]:
    path = response.request.url.path
    path = path if path in doc["paths"] else "/v1/models/{model}"
    return set(doc["paths"][path][response.request.method.lower()]["responses"])


def _probes(schema: dict[str, Any]) -> Iterator[tuple[Any, bool]]:
    """(value, accepted) at each bound of a numeric schema: the bound itself, and the nearest value beyond."""
    integer = "integer" in schema["type"]
    if "minimum" in schema:
        low = schema["minimum"]
        yield low, True
        yield (low - 1 if integer else low - 1e-9), False
    if "exclusiveMinimum" in schema:
        low = schema["exclusiveMinimum"]
        yield low, False
        yield (low + 1 if integer else math.ulp(low)), True
    if "maximum" in schema:
        high = schema["maximum"]
        yield high, True
        yield (high + 1 if integer else high + 1e-9), False


def _numeric_fields(doc: dict[str, Any], component: str) -> Iterator[tuple[str, dict[str, Any]]]:
    for name, schema in doc["components"]["schemas"][component].get("properties", {}).items():
        if isinstance(schema.get("type"), list) and {"integer", "number"} & set(schema["type"]):
            yield name, schema


def test_every_documented_bound_is_the_one_the_proxy_enforces(state: ProxyState) -> None:
    doc = document(state)
    cases = []
    for path, component in ENDPOINTS.items():
        companions = RESPONSES_COMPANIONS if path == "/v1/responses" else COMPANIONS
        for name, schema in _numeric_fields(doc, component):
            if (path, name) in NOT_PROBED:
                continue
            for value, accepted in _probes(schema):
                body = {**BASE_BODIES[path], name: value, **companions.get(name, lambda v: {})(value)}
                cases.append((path, name, value, accepted, body))
    assert {name for _, name, *_ in cases} >= {"n", "temperature", "top_p", "top_k", "seed", "logprobs",
                                                "top_logprobs", "max_tokens", "max_completion_tokens", "min_tokens",
                                                "max_output_tokens"}
    assert {path for path, *_ in cases} >= {"/v1/completions", "/v1/chat/completions", "/v1/responses"}
    responses = served(state, [("POST", path, body) for path, _, _, _, body in cases])
    for (path, name, value, accepted, _), response in zip(cases, responses, strict=True):
        if accepted and name in ("max_tokens", "max_completion_tokens", "max_output_tokens") and path != \
                "/v1/completions":
            # the chat template's tokens come on top: the bound fits only the completions' one-token prompt
            assert response.status_code == 200 or response.json()["error"]["code"] == "context_length_exceeded"
        elif accepted:
            assert response.status_code == 200, (path, name, value, response.text)
        else:
            assert response.status_code == 400, (path, name, value, response.text)
            assert response.json()["error"]["param"] in {name} | ALSO_BLAMED.get(name, set()), (name, response.text)


def test_token_id_bounds_are_the_vocabulary_and_the_wire(state: ProxyState) -> None:
    doc = document(state)
    prompt = doc["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    token_id = next(s["items"] for s in prompt["anyOf"] if s.get("items", {}).get("type") == "integer")
    assert token_id["maximum"] == len(state.tokenizer) - 1
    stop_ids = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]["stop_token_ids"]["items"]
    chat = BASE_BODIES["/v1/chat/completions"]
    ok_prompt, bad_prompt, ok_stop, bad_stop, negative_stop = served(state, [
        ("POST", "/v1/completions", {"prompt": [token_id["maximum"]], "max_tokens": 2}),
        ("POST", "/v1/completions", {"prompt": [token_id["maximum"] + 1], "max_tokens": 2}),
        ("POST", "/v1/chat/completions", {**chat, "stop_token_ids": [stop_ids["maximum"]]}),
        ("POST", "/v1/chat/completions", {**chat, "stop_token_ids": [stop_ids["maximum"] + 1]}),
        ("POST", "/v1/chat/completions", {**chat, "stop_token_ids": [stop_ids["minimum"] - 1]}),
    ])
    assert ok_prompt.status_code == ok_stop.status_code == 200, (ok_prompt.text, ok_stop.text)
    assert bad_prompt.status_code == 400 and bad_prompt.json()["error"]["param"] == "prompt"
    for bad in (bad_stop, negative_stop):
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "stop_token_ids"


def test_detokenize_takes_the_vocabularys_ids_and_tokenize_answers_them(state: ProxyState) -> None:
    schemas = document(state)["components"]["schemas"]
    token_id = schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert token_id == schemas["TokenizeResponse"]["properties"]["tokens"]["items"]
    assert (token_id["minimum"], token_id["maximum"]) == (0, len(state.tokenizer) - 1)
    ok, beyond, negative = served(state, [("POST", "/detokenize", {"tokens": [token_id[bound]]})
                                          for bound in ("maximum", "minimum")] +
                                  [("POST", "/detokenize", {"tokens": [token_id["maximum"] + 1]}),
                                   ("POST", "/detokenize", {"tokens": [token_id["minimum"] - 1]})])[1:]
    assert ok.status_code == 200, ok.text
    for bad in (beyond, negative):
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens", bad.text


def test_what_the_schema_refuses_the_proxy_refuses_and_what_it_allows_is_served(state: ProxyState) -> None:
    """Enums, consts, empty-only parameters and the cross-field rules the schema states: both sides of each."""
    chat = BASE_BODIES["/v1/chat/completions"]
    completion = BASE_BODIES["/v1/completions"]
    cases: list[tuple[str, dict[str, Any]]] = [
        ("/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", {**chat, "stream": True, "stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", {**chat, "top_logprobs": 2}),
        ("/v1/chat/completions", {**chat, "top_logprobs": None}),
        ("/v1/chat/completions", {**chat, "tools": []}),
        ("/v1/chat/completions", {**chat, "tools": [{"type": "function"}]}),
        ("/v1/chat/completions", {**chat, "tools": {}}),
        ("/v1/chat/completions", {**chat, "logit_bias": {}}),
        ("/v1/chat/completions", {**chat, "logit_bias": {"5": 1}}),
        ("/v1/chat/completions", {**chat, "logit_bias": 0}),
        ("/v1/chat/completions", {**chat, "response_format": {"type": "text"}}),
        ("/v1/chat/completions", {**chat, "response_format": {"type": "json_object"}}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None, "tool_calls": []}]}),
        ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x", "tool_calls": 0}]}),
        ("/v1/chat/completions", {**chat, "model": "m"}),
        ("/v1/chat/completions", {**chat, "model": ""}),
        ("/v1/chat/completions", {**chat, "max_completion_tokens": 3, "max_tokens": "many"}),
        ("/v1/completions", {**completion, "echo": False}),
        ("/v1/completions", {**completion, "echo": True}),
        ("/v1/completions", {**completion, "suffix": ""}),
        ("/v1/completions", {**completion, "suffix": "after"}),
        ("/v1/completions", {**completion, "suffix": 0}),
        ("/v1/completions", {**completion, "prompt": ["a", ""]}),
        ("/v1/completions", {**completion, "prompt": [[1], []]}),
    ]
    _served_as_valid(state, cases)


TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
MESSAGES = [{"role": "user", "content": "hi"}]


def test_what_the_schema_refuses_of_responses_and_tokenize_the_proxy_refuses(state: ProxyState) -> None:
    """The same for /v1/responses, /tokenize and /detokenize: stateless fields, unknown fields (null is absent for
    /v1/responses only), input items, tools, text formats, metadata, and the tokenize request's two forms."""
    answer = BASE_BODIES["/v1/responses"]
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": ""}
    cases: list[tuple[str, dict[str, Any]]] = [("/v1/responses", {**answer, **extra}) for extra in [
        {"top_logprobs": 2}, {"top_logprobs": 2, "include": [LOGPROBS_INCLUDE]}, {"top_logprobs": None},
        {"include": ["reasoning.encrypted_content"]}, {"store": False}, {"store": True}, {"background": False},
        {"background": True}, {"previous_response_id": None}, {"previous_response_id": "resp_1"}, {"seed": None},
        {"seed": 1}, {"truncation": "disabled"}, {"truncation": "auto"}, {"text": {"format": {"type": "json_object"}}},
        {"text": {"format": None}}, {"text": {"verbosity": "low"}}, {"text": {"format": {"type": "json_schema"}}},
        {"text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}}},
        {"reasoning": {"effort": "low", "summary": None}}, {"reasoning": {"effort": "maximal"}},
        {"reasoning": {"depth": None}}, {"metadata": {"k": "v"}}, {"metadata": {"k": 1}},
        {"metadata": {str(i): "v" for i in range(17)}}, {"metadata": {"k" * 65: "v"}},
        {"tool_choice": "required"}, {"tools": [TOOL], "tool_choice": "required"}, {"tools": [], "tool_choice": "none"},
        {"tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"}},
        {"tools": [TOOL], "tool_choice": {"type": "function", "name": ""}},
        {"tools": [{**TOOL, "defer_loading": True}], "tool_choice": "none"}, {"tools": [{"type": "web_search"}]},
        {"input": ""}, {"input": []}, {"input": [{"type": []}]}, {"input": [{"type": "item_reference", "id": "x"}]},
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}], "id": "m", "status": 1}]},
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        {"input": [{"role": "user", "content": "x", "name": "me"}]}, {"input": [{"role": "tool", "content": "x"}]},
        {"input": [{"type": "reasoning", "summary": [], "anything": 1}, *MESSAGES]},
        {"input": [*MESSAGES, call, {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]},
        {"input": [*MESSAGES, {**call, "arguments": "[1]"}]}, {"input": [{"type": "function_call_output"}]}]]
    cases += [("/tokenize", body) for body in [
        {"prompt": ""}, {"prompt": "x", "messages": None}, {"messages": MESSAGES, "prompt": None}, {"prompt": None},
        {"prompt": "x", "add_special_tokens": False, "return_token_strs": None}, {"prompt": "x", "tools": None},
        {"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": True},
        {"messages": [*MESSAGES, {"role": "assistant", "content": "It"}], "continue_final_message": True},
        {"messages": MESSAGES, "chat_template": None}, {"messages": MESSAGES, "chat_template": "{{ messages }}"},
        {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]},
        {"messages": MESSAGES, "tool_choice": None}, {"messages": []}]]
    cases += [("/detokenize", body) for body in [
        {"tokens": []}, {"tokens": [1.0]}, {"tokens": [True]}, {"tokens": [1], "model": None},
        {"tokens": [1], "skip_special_tokens": None}, {}]]
    _served_as_valid(state, cases)


def _served_as_valid(state: ProxyState, cases: list[tuple[str, dict[str, Any]]]) -> None:
    """Each body is served (200) if its path's request schema holds it, refused (400) if not."""
    doc = document(state)
    validators = {path: validator(doc, component) for path, component in ENDPOINTS.items()}
    responses = served(state, [("POST", path, body) for path, body in cases])
    for (path, body), response in zip(cases, responses, strict=True):
        schema_valid = validators[path].is_valid(body)
        assert response.status_code == (200 if schema_valid else 400), (path, body, response.text)


def test_a_responses_stream_is_the_documented_events_without_done(state: ProxyState) -> None:
    doc = document(state)
    (response,) = served(state, [("POST", "/v1/responses", {**BASE_BODIES["/v1/responses"], "stream": True})])
    assert response.headers["content-type"].startswith("text/event-stream"), response.text
    stream = doc["paths"]["/v1/responses"]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    events = [dict(line.split(": ", 1) for line in block.split("\n")) for block in response.text.split("\n\n")
              if block]
    for event in events:
        jsonschema.Draft202012Validator({**stream, "components": doc["components"]}).validate(event)
        validator(doc, "ResponseStreamEvent").validate(json.loads(event["data"]))
        assert json.loads(event["data"])["type"] == event["event"]
    assert events[-1]["event"] == "response.incomplete"  # max_output_tokens reached: the last event, no [DONE]


def test_an_api_key_guards_the_document_and_is_described(state: ProxyState) -> None:
    state.api_keys = APIKeys(["sk-test"])
    refused, allowed = served(state, [("GET", "/openapi.json", None)] * 2,
                              headers=[{}, {"Authorization": "Bearer sk-test"}])
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    doc = allowed.json()
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    for path in ENDPOINTS:
        assert doc["paths"][path]["post"]["security"] == [{"bearer": []}]
        assert "401" in doc["paths"][path]["post"]["responses"]
    assert "security" not in doc["paths"]["/health"]["get"]  # probes need no key
