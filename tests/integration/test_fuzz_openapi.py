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
NUM_EXAMPLES = {"POST": 40, "GET": 10}
TIME_BUDGET_S = 40.0


@pytest.fixture(scope="module")
def cluster(tiny_model: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(tiny_model("llama"), tmp_path_factory.mktemp("fuzz-logs"), with_guarded_proxy=False) as c:
        yield c


def narrowed(document: dict[str, Any]) -> dict[str, Any]:
    """The served document with small sizes: max_tokens 1..3 and always given (chat has no default), at most two
    choices, strings of at most 8 characters and lists of at most 3 items (2 messages), so that any prompt fits
    the tiny model's context of 256 tokens (a character is at most 4 byte tokens). best_of goes (it must equal n:
    a rule only a description states), min_tokens stops at 1 (it must not pass max_tokens), and structured output
    keeps only its JSON object mode."""
    doc = copy.deepcopy(document)
    schemas = doc["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest", "ChatMessage"):
        _cap(schemas[name], num_items=3, num_chars=8)
    schemas["ChatCompletionRequest"]["properties"]["messages"]["maxItems"] = 2
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
    return doc


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
    """A stream's events as its schema's contentSchema says (schemathesis reads `data` as text): each a chunk or
    an error envelope, and `[DONE]` last."""
    events = [block.removeprefix("data: ") for block in text.split("\n\n") if block]
    assert events and events[-1] == "[DONE]", text
    content = document["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]
    chunk_schema = content["schema"]["properties"]["data"]["anyOf"][1]["contentSchema"]
    validator = jsonschema.Draft202012Validator({**chunk_schema, "components": document["components"]})
    for event in events[:-1]:
        validator.validate(json.loads(event))


def test_the_proxy_survives_schemathesis_and_answers_as_its_schema_says(cluster: Cluster) -> None:
    served = httpx.get(f"{cluster.url}/openapi.json", timeout=10)
    assert served.status_code == 200
    document = served.json()
    # valid bodies from the narrowed schema (each costs a generation), invalid ones from the served schema (so
    # that only what the proxy promises to refuse is expected to be refused)
    runs = [(schemathesis.GenerationMode.POSITIVE, schemathesis.openapi.from_dict(narrowed(document))),
            (schemathesis.GenerationMode.NEGATIVE, schemathesis.openapi.from_dict(document))]
    for _, schema in runs:  # read whole streams: a prompt without max_tokens may generate up to the context
        schema.config.max_stream_events = 1000
    deadline = time.monotonic() + TIME_BUDGET_S  # past it, the remaining examples are skipped

    def call_and_check(case: schemathesis.Case) -> None:
        if time.monotonic() > deadline:
            return
        response = case.call(base_url=cluster.url, timeout=60)
        case.validate_response(response, checks=CHECKS)
        if 400 <= response.status_code < 500:
            assert set(response.json()["error"]) == ENVELOPE, response.text
        if response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
            check_events(response.text, document, case.operation.path)

    for mode, schema in runs:
        for result in schema.get_all_operations():
            assert isinstance(result, Ok), result  # the schema describes every operation well
            operation = result.ok()
            # the coverage phase: each bound, enum value and type of each field in turn, and methods the path
            # does not take (405 with an Allow header)
            generation = schema.config.generation_for(operation=operation)
            for case in schema.iter_coverage_cases(operation, generation_modes=[mode], generation_config=generation):
                call_and_check(case)
            if mode is schemathesis.GenerationMode.NEGATIVE and operation.method.upper() != "POST":
                continue  # nothing to get wrong at random: the GETs take no body, and any text as /v1/models/{model}

            @settings(max_examples=NUM_EXAMPLES[operation.method.upper()], deadline=None, database=None,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def fuzz(case: schemathesis.Case) -> None:
                call_and_check(case)

            fuzz()
    if time.monotonic() > deadline:
        warnings.warn(f"fuzzing was cut short by its time budget ({TIME_BUDGET_S} s): a slow machine, or "
                      "NUM_EXAMPLES too high", stacklevel=1)
    assert httpx.get(f"{cluster.url}/health", timeout=10).status_code == 200
    wait_until(lambda: all_resources_free(cluster))
