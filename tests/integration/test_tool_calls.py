"""Tool calling through a real cluster with the OpenAI SDK: `required` and a named function are held to JSON of
the call by the nodes (any model, even a random tiny one, returns arguments that validate), returned as OpenAI
`tool_calls` whole and streamed, the same tokens whether the request was disaggregated or colocated, and the
same as the offline engine's under the same seed. A template that cannot render tools (the tiny model's) gets
the documented fallback: the tools in a system message."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from engine import LLM, SamplingParams
from engine.tokenizer import load_tokenizer
from engine.types import StructuredOutputsParams
from proxy.api.chat_template import FALLBACK_INSTRUCTIONS
from tests.integration.openai_cluster import API_KEY, Cluster

pytestmark = pytest.mark.integration

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"type": "string", "maxLength": 6}}}}}
# a random tiny model greedily fills free strings with many-token escapes: the loop's tool takes names only
FORECAST = {"type": "function", "function": {
    "name": "forecast", "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                                       "properties": {"city": {"enum": ["Paris", "Rome"]}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
MODES = ("disaggregated", "colocated")


@pytest.fixture(scope="module")
def cluster(agentic_cluster: Cluster) -> Cluster:
    return agentic_cluster  # tests/integration/conftest.py


def clients(cluster: Cluster) -> dict[str, openai.OpenAI]:
    assert cluster.guarded_url is not None  # the router's default: short prompts are colocated on D
    return {"disaggregated": cluster.client(),
            "colocated": openai.OpenAI(base_url=f"{cluster.guarded_url}/v1", api_key=API_KEY, max_retries=0,
                                       timeout=60)}


def parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"]["parameters"]  # type: ignore[no-any-return]


def test_a_named_function_returns_one_call_whose_arguments_validate(cluster: Cluster) -> None:
    for mode, client in clients(cluster).items():
        chat = client.chat.completions.create(
            model=cluster.model.name, messages=ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = chat.choices[0]
        assert choice.finish_reason == "tool_calls", mode
        assert choice.message.content is None
        calls = choice.message.tool_calls or []
        assert len(calls) == 1 and calls[0].type == "function" and calls[0].function.name == "get_weather"
        assert calls[0].id.startswith("call_") and len(calls[0].id) == 29
        jsonschema.validate(json.loads(calls[0].function.arguments), parameters(WEATHER))


def test_required_returns_calls_of_the_given_tools_and_agrees_across_routes_and_offline(cluster: Cluster) -> None:
    found: dict[str, list[tuple[str, str]]] = {}
    for mode, client in clients(cluster).items():
        chat = client.chat.completions.create(
            model=cluster.model.name, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=150,
            temperature=1.0, seed=3, parallel_tool_calls=False)
        choice = chat.choices[0]
        assert choice.finish_reason == "tool_calls", (mode, choice)
        calls = choice.message.tool_calls or []
        assert len(calls) == 1  # parallel_tool_calls: false
        tool = {"get_weather": WEATHER, "get_time": TIME}[calls[0].function.name]
        jsonschema.validate(json.loads(calls[0].function.arguments), parameters(tool))
        found[mode] = [(c.function.name, c.function.arguments) for c in calls]
    assert found["disaggregated"] == found["colocated"]
    assert found["disaggregated"] == offline_required_calls(cluster, seed=3)


def offline_required_calls(cluster: Cluster, seed: int) -> list[tuple[str, str]]:
    """The engine alone, on the prompt the proxy renders (the tiny template cannot render tools: the fallback
    system message), under the same JSON schema and seed."""
    tokenizer = load_tokenizer(cluster.model)
    tools = [WEATHER["function"], TIME["function"]]
    system = FALLBACK_INSTRUCTIONS + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    text = tokenizer.apply_chat_template([{"role": "system", "content": system}, *ASK], tokenize=False,
                                         add_generation_prompt=True)
    prompt = list(tokenizer.encode(text, add_special_tokens=False))
    items = [{"type": "object", "properties": {"name": {"const": t["name"]}, "parameters": t["parameters"]},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema = {"type": "array", "items": {"anyOf": items}, "minItems": 1, "maxItems": 1}
    llm = LLM(model=str(cluster.model), dtype="float32")
    try:
        out = llm.generate([prompt], SamplingParams(
            temperature=1.0, seed=seed, max_tokens=150,
            structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True)))
    finally:
        llm.close()
    calls = json.loads(out[0].outputs[0].text)
    return [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]


def test_streamed_tool_calls_follow_openais_delta_shape_and_equal_the_whole_answer(cluster: Cluster) -> None:
    client = cluster.client()
    request: dict[str, Any] = {"model": cluster.model.name, "messages": ASK, "tools": [WEATHER], "max_tokens": 60,
                               "temperature": 0,
                               "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    whole = client.chat.completions.create(**request).choices[0].message.tool_calls or []
    chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    pieces = [call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or [])]
    first = pieces[0]
    assert first.index == 0 and first.id is not None and first.id.startswith("call_") and first.type == "function"
    assert first.function is not None and first.function.name == "get_weather"
    assert all(p.id is None and p.function is not None and p.function.name is None for p in pieces[1:])
    arguments = "".join(p.function.arguments or "" for p in pieces if p.function is not None)
    assert arguments == whole[0].function.arguments
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["tool_calls"]
    assert [c.usage is not None for c in chunks].count(True) == 1  # usage once, in the last chunk
    # the SDK's own accumulator reads the same call
    with client.chat.completions.stream(**request) as stream:
        final = stream.get_final_completion()
    streamed_calls = final.choices[0].message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in streamed_calls] == [("get_weather", arguments)]


def test_a_tool_loop_renders_the_call_and_its_result_into_the_next_prompt(cluster: Cluster) -> None:
    client = cluster.client()
    first = client.chat.completions.create(model=cluster.model.name, messages=ASK, tools=[FORECAST], max_tokens=150,
                                           temperature=0, tool_choice="required")
    assert first.choices[0].finish_reason == "tool_calls", first.choices[0]
    call = (first.choices[0].message.tool_calls or [])[0]
    history: list[Any] = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18})}]
    answer = client.chat.completions.create(model=cluster.model.name, messages=history, tools=[FORECAST],
                                            tool_choice="none", max_tokens=5, temperature=0)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason == "length"
    # the prompt holds the call (fallback: in the assistant's content) and the result: it is longer by both
    tokenizer = load_tokenizer(cluster.model)
    rendered_call = json.dumps({"name": "forecast", "arguments": json.loads(call.function.arguments)})
    assert answer.usage is not None and first.usage is not None
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens + len(tokenizer.encode(rendered_call))


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),  # this proxy has no --enable-auto-tool-choice
    ({"tools": [WEATHER]}, "tool_choice"),  # with tools, tool_choice defaults to auto (OpenAI's, vLLM's)
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "code_interpreter"}], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"functions": [WEATHER["function"]]}, "functions"),
])
def test_tool_requests_the_server_cannot_honour_are_400s_naming_the_field(cluster: Cluster, body: dict[str, Any],
                                                                         param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        cluster.client().chat.completions.create(model=cluster.model.name, messages=ASK, max_tokens=4,
                                                 extra_body=body)
    error = caught.value.body
    assert isinstance(error, dict) and error.get("param") == param, error
