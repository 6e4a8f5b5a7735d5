"""The request-field table (proxy/api/fields.py) against what it describes: every field of OpenAI's request types
(as the official SDK declares them) is in it, the OpenAPI document lists exactly its fields, every refused field
is a 400 that names it (and its neutral values are served), an unknown field is a 400, and the README's table is
the table's."""

from __future__ import annotations

import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from proxy.api.fields import FIELDS, Endpoint, Support, fields_of, markdown_table
from proxy.api.parsers import REASONING_PARSERS, TOOL_PARSERS
from proxy.api.serving import ProxyState
from settings.chat import REASONING_PARSERS as REASONING_CHOICES
from settings.chat import TOOL_CALL_PARSERS
from tests.unit.test_openai_api import ScriptedPipeline
from tests.unit.test_openapi import document, served

ROOT = Path(__file__).resolve().parents[2]
PATHS = {Endpoint.COMPLETIONS: "/v1/completions", Endpoint.CHAT: "/v1/chat/completions"}
SCHEMAS = {Endpoint.COMPLETIONS: "CompletionRequest", Endpoint.CHAT: "ChatCompletionRequest"}
BASE = {Endpoint.COMPLETIONS: {"prompt": [1], "max_tokens": 2},
        Endpoint.CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
OPENAI_TYPES = {Endpoint.COMPLETIONS: completion_create_params.CompletionCreateParamsBase,
                Endpoint.CHAT: chat_create_params.CompletionCreateParamsBase}


@pytest.fixture
def state(tokenizer_dir: Path) -> Iterator[ProxyState]:
    from transformers import AutoTokenizer

    state = ProxyState(ScriptedPipeline([5, 6]), AutoTokenizer.from_pretrained(str(tokenizer_dir)), "m",
                       max_model_len=256)
    yield state
    state.close()


@pytest.mark.parametrize("endpoint", list(Endpoint))
def test_every_field_of_openais_request_is_in_the_table(endpoint: Endpoint) -> None:
    openai_fields = set(typing.get_type_hints(OPENAI_TYPES[endpoint])) | {"stream"}
    assert openai_fields - set(fields_of(endpoint)) == set()


@pytest.mark.parametrize("endpoint", list(Endpoint))
def test_the_openapi_document_lists_exactly_the_tables_fields(state: ProxyState, endpoint: Endpoint) -> None:
    schema = document(state)["components"]["schemas"][SCHEMAS[endpoint]]
    assert set(schema["properties"]) == set(fields_of(endpoint))
    assert schema["additionalProperties"] is False


@pytest.mark.parametrize("endpoint", list(Endpoint))
def test_refused_fields_are_400s_naming_them_and_their_neutral_values_are_served(state: ProxyState,
                                                                                 endpoint: Endpoint) -> None:
    refused = [f for f in fields_of(endpoint).values() if f.support is Support.REFUSED]
    requests: list[tuple[str, str, Any]] = []
    for field in refused:
        requests.append(("POST", PATHS[endpoint], {**BASE[endpoint], field.name: "something"}))
        requests += [("POST", PATHS[endpoint], {**BASE[endpoint], field.name: v}) for v in (None, *field.neutral)]
    responses = iter(served(state, requests))
    for field in refused:
        refusal = next(responses)
        assert refusal.status_code == 400, (field.name, refusal.text)
        error = refusal.json()["error"]
        assert (error["param"], error["code"]) == (field.name, "unsupported_parameter")
        for value in (None, *field.neutral):
            answer = next(responses)
            assert answer.status_code == 200, (field.name, value, answer.text)


@pytest.mark.parametrize("endpoint", list(Endpoint))
def test_an_unknown_field_is_a_400_naming_it(state: ProxyState, endpoint: Endpoint) -> None:
    (response,) = served(state, [("POST", PATHS[endpoint], {**BASE[endpoint], "temprature": 0.5})])
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "temprature"
    assert response.json()["error"]["code"] == "unknown_parameter"


def test_the_readme_holds_the_tables_rows() -> None:
    readme = (ROOT / "README.md").read_text()
    assert markdown_table() in readme, "README.md's request-field table is stale: paste markdown_table()'s output"


def test_every_row_names_its_origin_and_no_field_is_listed_twice_for_one_endpoint() -> None:
    assert {f.origin for f in FIELDS} == {"OpenAI", "vLLM"}
    for endpoint in Endpoint:
        names = [f.name for f in FIELDS if endpoint in f.endpoints]
        assert len(names) == len(set(names))


def test_the_settings_parser_names_are_the_registries() -> None:
    assert set(TOOL_CALL_PARSERS) == set(TOOL_PARSERS)
    assert set(REASONING_CHOICES) == set(REASONING_PARSERS)
