"""/v1/responses through the official `openai` SDK and the OpenAI Agents SDK against a live cluster (tiny llama): text,
forced function calls whose arguments validate, a tool loop, streaming with the SDK's stream helper, and refusals.
A tiny random model calls no tool on its own: the tests force calls (tool_choice required or a named function), which
the nodes hold to the tool's schema."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any, Literal

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.integration.openai_cluster import CHAT, Cluster

pytestmark = pytest.mark.integration

# an enum keeps the random model's arguments short: they always end within max_output_tokens
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
              "required": ["city"], "additionalProperties": False}
TOOL: Any = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
             "parameters": PARAMETERS, "strict": True}
# A text answer that ends on its own (status completed) whatever the model: the SDK's stream helper and the Agents
# SDK take nothing else as a final answer. A JSON string of an enum: an object would leave room for whitespace, which
# a random model writes until max_output_tokens.
ANSWER = {"type": "string", "enum": ["yes", "no"]}
FORMAT: Any = {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}


@pytest.fixture(scope="module")
def cluster(agentic_cluster: Cluster) -> Cluster:
    return agentic_cluster  # tests/integration/conftest.py


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
    # one call: a random model would go on adding parallel calls until max_output_tokens
    r = cluster.client().responses.create(model=cluster.model.name, input="Weather in Paris?", tools=[TOOL],
                                          tool_choice="required", parallel_tool_calls=False, max_output_tokens=64,
                                          temperature=0)
    (call,) = r.output
    assert r.status == "completed" and call.type == "function_call"
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
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
    kwargs: dict[str, Any] = {"model": cluster.model.name, "input": "Yes or no?", "text": {"format": FORMAT},
                              "max_output_tokens": 48, "temperature": 0}
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text
    jsonschema.validate(json.loads(text), ANSWER)
    whole = client.responses.create(**kwargs)
    assert whole.output_text == text and whole.usage is not None and final.usage is not None
    assert whole.usage.output_tokens == final.usage.output_tokens
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


def test_an_agent_calls_its_tool_then_answers(cluster: Cluster) -> None:
    """The OpenAI Agents SDK (its OpenAIResponsesModel), two turns: a forced call (ModelSettings tool_choice required),
    then an answer in the agent's output type (text.format). The SDK's own reset (Agent.reset_tool_choice) would leave
    tool_choice out of the second request, i.e. auto, where a random model calls again: the agent says "none" itself
    once its tool ran."""
    from agents import (
        Agent,
        AgentHooks,
        AgentOutputSchemaBase,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # the SDK would export traces to OpenAI's servers
    cities: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        cities.append(city)
        return "snow"

    class Answer(AgentOutputSchemaBase):
        """The agent's final answer: "yes" or "no" as JSON (ANSWER)."""

        def is_plain_text(self) -> bool:
            return False

        def name(self) -> str:
            return "answer"

        def json_schema(self) -> dict[str, Any]:
            return ANSWER

        def is_strict_json_schema(self) -> bool:
            return True

        def validate_json(self, json_str: str) -> Any:
            answer = json.loads(json_str)
            jsonschema.validate(answer, ANSWER)
            return answer

    class AnswerAfterTheTool(AgentHooks[Any]):
        async def on_tool_end(self, context: Any, agent: Agent[Any], tool: Any, result: object) -> None:
            agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice="none")

    async def run() -> Any:
        client = openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=60)
        settings = ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=64, temperature=0)
        agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                      model=OpenAIResponsesModel(model=cluster.model.name, openai_client=client), output_type=Answer(),
                      model_settings=settings, reset_tool_choice=False, hooks=AnswerAfterTheTool())
        try:
            return await Runner.run(agent, "Weather in Oslo?", max_turns=2)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert len(cities) == 1 and cities[0] in ("Paris", "Oslo")
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    assert result.final_output in ("yes", "no") and len(result.raw_responses) == 2
