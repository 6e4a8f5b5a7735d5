"""schemathesis against a live proxy (real prefill and decode nodes, tiny model, CPU), driven by the proxy's own
GET /openapi.json: bodies the schema allows must be served (2xx), bodies it forbids refused with a 4xx, never a
5xx, every 4xx with the OpenAI error envelope, and every response as the schema describes it. Afterwards nothing
is left on the nodes.

The schema fuzzed is the served one with its sizes narrowed (see `narrowed`), so that a few hundred requests fit
in well under a minute on two cores: a couple of tokens to generate, short prompts and conversations, at most two
choices. The narrowing keeps every type, enum and cross-field rule as served.
"""

from __future__ import annotations

import copy
import json
import time
import warnings
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    positive_data_acceptance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from tests.fixtures.tiny_models import TinyModelFactory
from tests.integration.openai_cluster import Cluster, all_resources_free, running_cluster, wait_until

pytestmark = pytest.mark.integration

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance, positive_data_acceptance, negative_data_rejection, unsupported_method]
ENVELOPE = {"message", "type", "param", "code"}
# examples per operation and mode; the generating endpoints cost a real generation each
NUM_EXAMPLES = {"POST": 25, "GET": 10}
TIME_BUDGET_S = 40.0
# each operation and mode's weight in its share of the time left: a generation costs most, a tokenizer call less,
# a GET (any other path) little
SHARES = {"/v1/completions": 3.0, "/v1/chat/completions": 3.0, "/v1/responses": 3.0, "/tokenize": 1.0,
          "/detokenize": 1.0}


@pytest.fixture(scope="module")
def cluster(tiny_model: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(tiny_model("llama"), tmp_path_factory.mktemp("fuzz-logs"), with_guarded_proxy=False) as c:
        yield c


def narrowed(document: dict[str, Any]) -> dict[str, Any]:
    """The served document with small sizes: max_tokens 1..3 and always given (chat has no default), at most two
    choices, strings of at most 8 characters and lists of at most 3 items (2 messages), so that any prompt fits
    the tiny model's context of 256 tokens (a character is at most 4 byte tokens). Rules only a description
    states are kept out: best_of goes (it must equal n), min_tokens stops at 1 (it must not pass max_tokens),
    logit_bias names ids of the tiny vocabulary (1000), chat's continue_final_message is false (it needs
    add_generation_prompt false), an earlier tool call's arguments are an object (as text, they must be the JSON
    of one), and structured output keeps only its JSON object mode. /v1/responses alike:
    max_output_tokens 1..3 and always given, an earlier function call's arguments one of a few JSON texts,
    text.format text or json_object, at most 2 text parts (instructions come on top). Chat and responses have no
    tools: the tiny context cannot hold their instructions (about 210 tokens where the template renders no tools),
    and tool_choice is none. /tokenize's chat has one tool at most
    (names must be unique), without parameters (a schema must be valid against its metaschema)."""
    doc = copy.deepcopy(document)
    schemas = doc["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest", "ChatMessage", "ResponseRequest", "TokenizeRequest",
                 "DetokenizeRequest"):
        _cap(schemas[name], num_items=3, num_chars=8)
    schemas["ChatCompletionRequest"]["properties"]["messages"]["maxItems"] = 2
    _narrow_responses(schemas["ResponseRequest"])
    tokenize_tools = _not_null(schemas["TokenizeRequest"]["oneOf"][1]["properties"]["tools"])
    tokenize_tools["maxItems"] = 1
    tokenize_tools["items"]["properties"]["function"]["properties"]["parameters"] = {"type": "null"}
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        request = schemas[name]
        properties = request["properties"]
        for key in ("max_tokens", "max_completion_tokens"):
            if key in properties:
                properties[key] = {"type": "integer", "minimum": 1, "maximum": 3}
        request["required"] = [*request["required"], "max_tokens"]
        properties["n"]["maximum"] = 2
        properties["min_tokens"]["maximum"] = 1
        del properties["best_of"]
        # structured output: a schema, regex or grammar must also compile (a rule only a description states), and a
        # random one costs a compile on each node; test_structured_output.py covers them. JSON objects stay.
        for key in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            del properties[key]
        properties["response_format"] = {"type": ["object", "null"], "required": ["type"],
                                          "properties": {"type": {"enum": ["text", "json_object"]}}}
        properties["logit_bias"]["propertyNames"] = {"pattern": "^[0-9]{1,3}$"}  # the tiny vocabulary: 1000 ids
    chat = schemas["ChatCompletionRequest"]["properties"]
    chat.update(tools={"enum": [None, []]}, tool_choice={"enum": [None, "none"]},
                continue_final_message={"enum": [None, False]})
    history_call = _not_null(schemas["ChatMessage"]["properties"]["tool_calls"])["items"]
    history_call["properties"]["function"]["properties"]["arguments"] = {"type": ["object", "null"]}
    return doc


def _not_null(schema: dict[str, Any]) -> dict[str, Any]:
    """A nullable field's schema without its null (proxy/api/openapi_parts.nullable: a type list or an anyOf)."""
    return schema["anyOf"][0] if "anyOf" in schema else schema


def _narrow_responses(request: dict[str, Any]) -> None:
    properties = request["properties"]
    items = properties["input"]["anyOf"][1]
    items["maxItems"] = 2
    for item in items["items"]["anyOf"]:
        for key in ("content", "output"):
            if key in item["properties"]:
                item["properties"][key]["anyOf"][1]["maxItems"] = 2
    # an earlier call's arguments: the schema's pattern admits text that is not JSON ("{x}"), which is refused
    call = next(item for item in items["items"]["anyOf"] if item["properties"]["type"].get("const") == "function_call")
    call["properties"]["arguments"] = {"enum": ["", "{}", ' {"a": [1, "b"]}\n']}
    properties["max_output_tokens"] = {"type": "integer", "minimum": 1, "maximum": 3}
    properties["tools"] = {"enum": [None, []]}
    properties["tool_choice"] = {"enum": [None, "none"]}
    request["required"] = [*request["required"], "max_output_tokens"]
    properties["text"]["properties"]["format"] = {"type": ["object", "null"], "required": ["type"],
                                                  "properties": {"type": {"enum": ["text", "json_object"]}}}


def _cap(schema: Any, num_items: int, num_chars: int) -> None:
    """Caps every list and string in `schema` (a JSON Schema), at any depth."""
    if isinstance(schema, list):
        for item in schema:
            _cap(item, num_items, num_chars)
        return
    if not isinstance(schema, dict):
        return
    kinds = schema.get("type", [])
    if "array" in kinds:
        schema["maxItems"] = min(schema.get("maxItems", num_items), num_items)
    if "string" in kinds and "const" not in schema and "enum" not in schema:
        schema["maxLength"] = min(schema.get("maxLength", num_chars), num_chars)
    for key in ("items", "anyOf", "allOf", "oneOf"):
        _cap(schema.get(key), num_items, num_chars)
    _cap(list(schema.get("properties", {}).values()), num_items, num_chars)


def check_events(text: str, document: dict[str, Any], path: str) -> None:
    """A stream's events as its schema's contentSchema says (schemathesis reads `data` as text): for completions
    and chat each a chunk or an error envelope, and `[DONE]` last; for responses each a Responses event that its
    `event:` line names, the last one the response's end (no `[DONE]`)."""
    blocks = [dict(line.split(": ", 1) for line in block.split("\n")) for block in text.split("\n\n") if block]
    events = [block["data"] for block in blocks]
    if path == "/v1/responses":
        assert blocks and blocks[-1]["event"] in ("response.completed", "response.incomplete", "response.failed"), text
        assert all(json.loads(block["data"])["type"] == block["event"] for block in blocks), text
    else:
        assert events and events[-1] == "[DONE]", text
        events = events[:-1]
    data = document["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]["properties"][
        "data"]
    chunk_schema = next(s["contentSchema"] for s in data.get("anyOf", [data]) if "contentSchema" in s)
    validator = jsonschema.Draft202012Validator({**chunk_schema, "components": document["components"]})
    for event in events:
        validator.validate(json.loads(event))


def test_the_proxy_survives_schemathesis_and_answers_as_its_schema_says(cluster: Cluster) -> None:
    served = httpx.get(f"{cluster.url}/openapi.json", timeout=10)
    assert served.status_code == 200
    document = served.json()
    # valid bodies from the narrowed schema (each costs a generation), invalid ones from the served schema (so
    # that only what the proxy promises to refuse is expected to be refused)
    runs = [(schemathesis.GenerationMode.POSITIVE, schemathesis.openapi.from_dict(narrowed(document))),
            (schemathesis.GenerationMode.NEGATIVE, schemathesis.openapi.from_dict(document))]
    operations = []
    for mode, schema in runs:
        schema.config.max_stream_events = 1000  # read whole streams: without max_tokens, up to the context
        for result in schema.get_all_operations():
            assert isinstance(result, Ok), result  # the schema describes every operation well
            operations.append((mode, schema, result.ok()))
    deadline = time.monotonic() + TIME_BUDGET_S  # past it, the remaining examples are skipped
    until = deadline  # the current operation's share ends
    cut_short = False

    def call_and_check(case: schemathesis.Case) -> None:
        nonlocal cut_short
        if time.monotonic() > until:
            cut_short = True
            return
        response = case.call(base_url=cluster.url, timeout=60)
        case.validate_response(response, checks=CHECKS)
        if 400 <= response.status_code < 500:
            assert set(response.json()["error"]) == ENVELOPE, response.text
        if response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
            check_events(response.text, document, case.operation.path)

    for i, (mode, schema, operation) in enumerate(operations):
        # a share of the time left, so that a slow operation (the coverage phase of chat's many fields) does not
        # starve those after it; what one leaves unused goes to the rest
        shares = [SHARES.get(later.path, 0.1) for _, _, later in operations[i:]]
        until = time.monotonic() + max(0.0, deadline - time.monotonic()) * shares[0] / sum(shares)
        # the coverage phase: each bound, enum value and type of each field in turn, and methods the path
        # does not take (405 with an Allow header)
        generation = schema.config.generation_for(operation=operation)
        for case in schema.iter_coverage_cases(operation, generation_modes=[mode], generation_config=generation):
            call_and_check(case)
            if time.monotonic() > until:
                cut_short = True
                break
        if mode is schemathesis.GenerationMode.NEGATIVE and operation.method.upper() != "POST":
            continue  # nothing to get wrong at random: the GETs take no body, and any text as /v1/models/{model}

        # derandomized: CI runs the same examples every time, so a failure is a regression, not a new draw
        @settings(max_examples=NUM_EXAMPLES[operation.method.upper()], deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def fuzz(case: schemathesis.Case) -> None:
            call_and_check(case)

        fuzz()
    if cut_short:
        warnings.warn(f"fuzzing was cut short by the time budget ({TIME_BUDGET_S} s, shared by the operations): "
                      "a slow machine, or NUM_EXAMPLES too high", stacklevel=1)
    assert httpx.get(f"{cluster.url}/health", timeout=10).status_code == 200
    wait_until(lambda: all_resources_free(cluster))
