"""/v1/responses through the official `openai` SDK and the OpenAI Agents SDK against a live cluster (tiny llama): text,
forced function calls whose arguments validate, a tool loop, streaming with the SDK's stream helper, and refusals.
A tiny random model calls no tool on its own: the tests force calls (tool_choice required or a named function), which
the nodes hold to the tool's schema."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.fixtures.tiny_models import TinyModelFactory
from tests.integration.openai_cluster import CHAT, Cluster, running_cluster
from tests.integration.processes import Process, start_proxy

pytestmark = pytest.mark.integration

# an enum keeps the random model's arguments short: they always end within max_output_tokens
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
              "required": ["city"], "additionalProperties": False}
TOOL: Any = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
             "parameters": PARAMETERS, "strict": True}


@pytest.fixture(scope="module")
def cluster(tiny_model: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # a context (and KV cache) for the tools: the tiny template cannot render them, so the proxy describes them in a
    # long system message
    with running_cluster(tiny_model("llama", max_position_embeddings=1024), tmp_path_factory.mktemp("responses-logs"),
                         with_guarded_proxy=False, node_args=["--num-kv-blocks", "512"]) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def auto_url(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A proxy of the same nodes that serves tool_choice auto (hermes calls), as an agent's later turns need."""
    process: Process | None = None
    try:
        process, url = start_proxy(cluster.model, cluster.prefill_address, cluster.decode_address,
                                   tmp_path_factory.mktemp("auto-proxy-logs"),
                                   ["--block-size", "4", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
        yield url
    finally:
        if process is not None:
            process.stop()


@pytest.fixture(scope="module")
def tokenizer(cluster: Cluster) -> Any:
    return AutoTokenizer.from_pretrained(str(cluster.model))


def test_text_input_answers_with_a_message_and_counts_the_templated_prompt(cluster: Cluster, tokenizer: Any) -> None:
    client = cluster.client()
    (system, user) = CHAT
    r = client.responses.create(model=cluster.model.name, instructions=system["content"], input=user["content"],
                                max_output_tokens=6, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    assert r.output_text
    prompt = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert r.usage is not None and r.usage.input_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert 0 < r.usage.output_tokens <= 6 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # the same chat through /v1/chat/completions gives the same greedy text
    chat = client.chat.completions.create(model=cluster.model.name, messages=CHAT, max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == r.output_text


def test_a_required_tool_choice_is_a_function_call_whose_arguments_validate(cluster: Cluster) -> None:
    r = cluster.client().responses.create(model=cluster.model.name, input="Weather in Paris?", tools=[TOOL],
                                          tool_choice="required", max_output_tokens=64, temperature=0)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and r.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), PARAMETERS)


def test_a_tool_loop_returns_the_calls_output_and_gets_a_text_answer(cluster: Cluster) -> None:
    client = cluster.client()
    conversation: list[Any] = [{"role": "user", "content": "Weather in Oslo?"}]
    first = client.responses.create(model=cluster.model.name, input=conversation, tools=[TOOL],
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=64,
                                    temperature=0)
    (call,) = first.output
    assert call.type == "function_call"
    jsonschema.validate(json.loads(call.arguments), PARAMETERS)
    conversation += [*first.output, {"type": "function_call_output", "call_id": call.call_id,
                                     "output": json.dumps({"forecast": "snow"})}]
    second = client.responses.create(model=cluster.model.name, input=conversation, tools=[TOOL], tool_choice="none",
                                     max_output_tokens=8, temperature=0)
    assert [item.type for item in second.output] == ["message"]
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens  # the call and its output are in the prompt


def test_a_stream_read_by_the_sdks_helper_accumulates_to_its_final_response(cluster: Cluster) -> None:
    client = cluster.client()
    with client.responses.stream(model=cluster.model.name, input="Say something.", max_output_tokens=8,
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and text == final.output_text
    whole = client.responses.create(model=cluster.model.name, input="Say something.", max_output_tokens=8,
                                    temperature=0)
    assert whole.output_text == text and whole.usage == final.usage
    # a forced call streams its arguments
    with client.responses.stream(model=cluster.model.name, input="Weather?", tools=[TOOL], max_output_tokens=64,
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:
        events = list(stream)
        (call,) = stream.get_final_response().output
    assert call.type == "function_call"
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    jsonschema.validate(json.loads(call.arguments), PARAMETERS)


@pytest.mark.parametrize("kwargs, param", [
    ({"store": True}, "store"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"previous_response_id": "resp_0"}, "previous_response_id"),
])
def test_what_a_stateless_server_cannot_do_is_refused_by_name(cluster: Cluster, kwargs: dict[str, Any], param: str
                                                              ) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        cluster.client().responses.create(model=cluster.model.name, input="hi", **kwargs)
    assert e.value.status_code == 400 and e.value.param == param


def test_an_agent_calls_its_tool_then_answers(cluster: Cluster, auto_url: str) -> None:
    """The OpenAI Agents SDK, two turns: a forced call (ModelSettings tool_choice required), then the SDK resets
    tool_choice (Agent.reset_tool_choice: the next request leaves it out, i.e. auto) and the model answers in text."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # the SDK would export traces to OpenAI's servers
    cities: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        cities.append(city)
        return "snow"

    async def run() -> Any:
        client = openai.AsyncOpenAI(base_url=f"{auto_url}/v1", api_key="unused", max_retries=0, timeout=60)
        model = OpenAIResponsesModel(model=cluster.model.name, openai_client=client)
        agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather], model=model,
                      model_settings=ModelSettings(tool_choice="required", max_tokens=48, temperature=0))
        try:
            return await Runner.run(agent, "Weather in Oslo?", max_turns=2)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert len(cities) == 1 and cities[0] in ("Paris", "Oslo")
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    assert isinstance(result.final_output, str) and len(result.raw_responses) == 2
