"""Structured output at the proxy's edge (proxy/api/structured_outputs.py) and on the wire (protos/convert.py): the
names OpenAI's, vLLM's and older vLLM clients send become one StructuredOutputsParams; malformed or conflicting
ones are a 400 naming the field; what /openapi.json describes is what the parser accepts; the constraint survives
protobuf."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from engine.types import SamplingParams, StructuredOutputsParams
from protos import tandem_pb2 as pb
from protos.convert import params_from_proto, params_to_proto
from proxy.api.errors import APIError
from proxy.api.openai_api import parse_chat, parse_completion
from proxy.api.openapi import ServedAPI, openapi_schema

MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def structured(extra: dict[str, Any]) -> StructuredOutputsParams | None:
    return parse_chat({"messages": MESSAGES, **extra}).generation.params.structured_outputs


@pytest.mark.parametrize("extra, expected", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     StructuredOutputsParams(json=SCHEMA, disable_additional_properties=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a-b_1", "schema": SCHEMA}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"disable_any_whitespace": True}},
     StructuredOutputsParams(json_object=True, disable_any_whitespace=True)),
    ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutputsParams(regex="[0-9]+")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutputsParams(choice=["a", "b"])),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutputsParams(grammar='root ::= "a"')),
    ({"structured_outputs": {"json": SCHEMA, "json_object": False}}, StructuredOutputsParams(json=SCHEMA)),
    ({"guided_json": '{"type": "integer"}'}, StructuredOutputsParams(json={"type": "integer"})),
    ({"guided_regex": "a+", "guided_decoding_backend": "xgrammar"}, StructuredOutputsParams(regex="a+")),
    ({"guided_choice": ["x"]}, StructuredOutputsParams(choice=["x"])),
    ({"guided_grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"')),
])
def test_openai_vllm_and_older_vllm_names_give_one_constraint(extra: dict[str, Any],
                                                              expected: StructuredOutputsParams | None) -> None:
    assert structured(extra) == expected
    completion = parse_completion({"prompt": "x", **extra}).generation.params.structured_outputs
    assert completion == expected


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nonsense"}}}},
     "response_format", "not a valid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"minimum": "1"}}}},
     "response_format", "schema['minimum']"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format", "name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "has space", "schema": SCHEMA}}},
     "response_format", "name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format", "required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": "yes"}}},
     "response_format", "strict"),
    ({"response_format": {"type": "yaml"}}, "response_format", "type"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "only one"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "only one"),
    ({"structured_outputs": {}}, "structured_outputs", "needs a constraint"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs", "needs a constraint"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs", "non-empty"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs", "choice"),
    # only json_object may be false ("not this one"): a false choice is a wrong type, found by schemathesis
    ({"structured_outputs": {"choice": False}}, "structured_outputs", "structured_outputs.choice"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs", "not supported"),
    ({"structured_outputs": "json"}, "structured_outputs", "object"),
    ({"guided_json": "{"}, "guided_json", "not valid JSON"),
    ({"guided_json": [1]}, "guided_json", "schema object"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
    ({"guided_whitespace_pattern": " ", "guided_regex": "a"}, "guided_whitespace_pattern", "not supported"),
])
def test_malformed_or_conflicting_constraints_are_a_400_naming_the_field(extra: dict[str, Any], param: str,
                                                                         words: str) -> None:
    with pytest.raises(APIError) as e:
        structured(extra)
    assert e.value.status == 400 and e.value.param == param and words in e.value.message, e.value.message


def test_what_the_document_describes_is_what_the_parser_accepts() -> None:
    document = openapi_schema(ServedAPI("m", 1000, 256, 1 << 20, False))
    request = document["components"]["schemas"]["ChatCompletionRequest"]
    validator = jsonschema.Draft202012Validator({**request, "components": document["components"]})
    bodies: list[dict[str, Any]] = [
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": None}}},
        {"structured_outputs": {"choice": ["a"], "disable_any_whitespace": None}},
        {"guided_regex": "a", "guided_decoding_backend": None},
        # forbidden by the document, refused by the parser
        {"response_format": {"type": "json_schema"}}, {"response_format": {"type": "json_schema",
                                                                          "json_schema": {"schema": SCHEMA}}},
        {"structured_outputs": {"regex": "a", "extra": 1}}, {"structured_outputs": {"choice": []}},
        {"guided_choice": "a"}, {"guided_whitespace_pattern": "x"}, {"guided_decoding_backend": "outlines"},
    ]
    for extra in bodies:
        body = {"messages": MESSAGES, **extra}
        try:
            parse_chat(body)
            accepted = True
        except APIError:
            accepted = False
        assert accepted == validator.is_valid(body), body


def test_a_constraint_survives_protobuf() -> None:
    for spec in (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
                 StructuredOutputsParams(json='{"type": "integer"}', disable_additional_properties=True),
                 StructuredOutputsParams(regex="[a-z]+"), StructuredOutputsParams(choice=["a", "b c"]),
                 StructuredOutputsParams(grammar='root ::= "x"'), StructuredOutputsParams(json_object=True)):
        params = SamplingParams(temperature=0.5, max_tokens=9, structured_outputs=spec)
        wire = pb.SamplingParams.FromString(params_to_proto(params).SerializeToString())
        back = params_from_proto(wire).structured_outputs
        assert back is not None and back.key() == spec.key()
    assert params_from_proto(params_to_proto(SamplingParams())).structured_outputs is None
    two = params_to_proto(SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")))
    two.structured_outputs.grammar = 'root ::= "a"'  # a peer that sets two: refused (the node's INVALID_ARGUMENT)
    with pytest.raises(ValueError, match="exactly one"):
        params_from_proto(two)
