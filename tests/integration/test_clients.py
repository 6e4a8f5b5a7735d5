"""Real clients against a real cluster: the OpenAI SDK's pydantic helpers (`parse`, `pydantic_function_tool`,
the streaming accumulator) and LangChain's ChatOpenAI (`bind_tools`, `with_structured_output`, a tool loop). The
nodes hold a named or `required` tool choice and a json_schema response_format to the schema, so even a random
tiny model's answers validate: each test checks the client's own parsing into the request's pydantic models and
names, never an answer the proxy gave before. The tiny template cannot render tools: the proxy describes them in a
system message (many tokens), hence the context and KV blocks below; the fields are enums or short strings, as a
random model fills a free string with many tokens; every schema is closed (no additional properties), as one
that is open lets the model invent keys until max_tokens."""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from tests.integration.openai_cluster import Cluster

pytestmark = pytest.mark.integration

ASK = "What is the weather in Paris?"
MAX_TOKENS = 150  # room for a call's JSON, which the constraint closes well before this
# vLLM's option, through the clients' extra_body: a response_format's JSON may hold any whitespace (as vLLM's), which
# a random model fills until max_tokens; the tools' constraint is compact already
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


class Weather(BaseModel):
    """The weather in a city."""

    model_config = ConfigDict(extra="forbid")  # additionalProperties: false
    city: Literal["Paris", "Rome", "Oslo"]
    unit: Literal["celsius", "fahrenheit"]


class Clock(BaseModel):
    """The time in a zone."""

    model_config = ConfigDict(extra="forbid")
    zone: str = Field(max_length=6)


class Verdict(BaseModel):
    """A short structured answer."""

    model_config = ConfigDict(extra="forbid")
    sunny: bool
    city: Literal["Paris", "Rome"]
    note: str = Field(max_length=8)


@tool  # its schema is open: bind_tools(strict=True) closes it, as OpenAI's strict mode asks
def forecast(city: Literal["Paris", "Rome"]) -> str:
    """The forecast for a city."""
    return json.dumps({"city": city, "temperature": 18})


@pytest.fixture(scope="module")
def cluster(agentic_cluster: Cluster) -> Cluster:
    return agentic_cluster  # tests/integration/conftest.py


def chat_model(cluster: Cluster, max_tokens: int = MAX_TOKENS) -> ChatOpenAI:
    # max_completion_tokens: the field max_tokens by its alias (the name mypy knows; it is what goes on the wire)
    return ChatOpenAI(base_url=f"{cluster.url}/v1", api_key=SecretStr("unused"), model=cluster.model.name,
                      temperature=0, max_completion_tokens=max_tokens, max_retries=0, timeout=60)


# ---- the OpenAI SDK ----

def test_sdk_parse_turns_a_named_tool_call_into_the_pydantic_model(cluster: Cluster) -> None:
    chat = cluster.client().chat.completions.parse(
        model=cluster.model.name, messages=[{"role": "user", "content": ASK}], max_tokens=MAX_TOKENS, temperature=0,
        tools=[openai.pydantic_function_tool(Weather), openai.pydantic_function_tool(Clock)],
        tool_choice={"type": "function", "function": {"name": "Weather"}})
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name == "Weather"
    assert isinstance(calls[0].function.parsed_arguments, Weather)
    jsonschema.validate(json.loads(calls[0].function.arguments), Weather.model_json_schema())


def test_sdk_parse_turns_required_calls_into_the_model_of_the_tool_called(cluster: Cluster) -> None:
    models: dict[str, type[BaseModel]] = {"Weather": Weather, "Clock": Clock}
    chat = cluster.client().chat.completions.parse(
        model=cluster.model.name, messages=[{"role": "user", "content": ASK}], max_tokens=MAX_TOKENS, temperature=0,
        tools=[openai.pydantic_function_tool(m) for m in models.values()], tool_choice="required",
        parallel_tool_calls=False)
    calls = chat.choices[0].message.tool_calls or []
    assert len(calls) == 1, chat.choices[0]
    assert isinstance(calls[0].function.parsed_arguments, models[calls[0].function.name])


def test_sdk_parse_turns_a_response_format_model_into_its_instance(cluster: Cluster) -> None:
    chat = cluster.client().chat.completions.parse(
        model=cluster.model.name, messages=[{"role": "user", "content": ASK}], max_tokens=60, temperature=0,
        response_format=Verdict, extra_body=COMPACT)
    message = chat.choices[0].message
    assert chat.choices[0].finish_reason == "stop", chat.choices[0]
    assert isinstance(message.parsed, Verdict)
    assert message.content is not None
    jsonschema.validate(json.loads(message.content), Verdict.model_json_schema())


def test_sdk_stream_accumulates_a_tool_call_into_the_pydantic_model(cluster: Cluster) -> None:
    arguments_done: list[Any] = []
    with cluster.client().chat.completions.stream(
            model=cluster.model.name, messages=[{"role": "user", "content": ASK}], max_tokens=MAX_TOKENS,
            temperature=0, tools=[openai.pydantic_function_tool(Weather)],
            tool_choice={"type": "function", "function": {"name": "Weather"}}) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.done":
                arguments_done.append(event.parsed_arguments)
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls", final.choices[0]
    calls = final.choices[0].message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name == "Weather"
    assert isinstance(calls[0].function.parsed_arguments, Weather)
    assert len(arguments_done) == 1 and isinstance(arguments_done[0], Weather)


# ---- LangChain's ChatOpenAI ----

@pytest.mark.parametrize("tool_choice", ["any", "Weather"])
def test_langchain_bind_tools_returns_a_call_of_a_bound_tool_with_valid_args(cluster: Cluster,
                                                                             tool_choice: str) -> None:
    # one call: a random model given a list of calls adds calls until max_tokens (then the list comes back as content)
    bound = chat_model(cluster).bind_tools([Weather, forecast], tool_choice=tool_choice, strict=True,
                                           parallel_tool_calls=False)
    answer = bound.invoke(ASK)
    assert isinstance(answer, AIMessage) and answer.tool_calls, answer
    call = answer.tool_calls[0]
    if tool_choice != "any":
        assert call["name"] == tool_choice
    if call["name"] == "Weather":
        Weather.model_validate(call["args"])
    else:
        assert call["name"] == "forecast"
        forecast.args_schema.model_validate(call["args"])  # type: ignore[union-attr]
    assert call["id"]


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_structured_output_returns_the_pydantic_model(cluster: Cluster, method: str) -> None:
    # function_calling binds Verdict as a tool named by tool_choice; json_schema sends it as a strict response_format
    extra: dict[str, Any] = {"extra_body": COMPACT} if method == "json_schema" else {}
    structured = chat_model(cluster).with_structured_output(Verdict, method=method, **extra)  # type: ignore[arg-type]
    answer = structured.invoke(ASK)
    assert isinstance(answer, Verdict)


def test_langchain_tool_loop_answers_after_the_tools_result(cluster: Cluster) -> None:
    question = HumanMessage(ASK)
    call_message = chat_model(cluster).bind_tools([forecast], tool_choice="forecast", strict=True).invoke([question])
    assert isinstance(call_message, AIMessage) and len(call_message.tool_calls) == 1, call_message
    result = forecast.invoke(call_message.tool_calls[0])  # a ToolCall in, a ToolMessage out
    assert isinstance(result, ToolMessage) and result.tool_call_id == call_message.tool_calls[0]["id"]
    history = [question, call_message, result]
    # bind_tools passes "none" on as is; without a tool_choice the request means auto, which this server refuses
    with pytest.raises(openai.BadRequestError):
        chat_model(cluster, max_tokens=5).bind_tools([forecast], strict=True).invoke(history)
    answer = chat_model(cluster, max_tokens=5).bind_tools([forecast], tool_choice="none", strict=True).invoke(history)
    assert isinstance(answer, AIMessage) and not answer.tool_calls
    assert isinstance(answer.content, str) and answer.content
    assert answer.response_metadata["finish_reason"] == "length"
    # the call and its result were rendered into the second prompt
    assert call_message.usage_metadata is not None and answer.usage_metadata is not None
    assert answer.usage_metadata["input_tokens"] > call_message.usage_metadata["input_tokens"]

