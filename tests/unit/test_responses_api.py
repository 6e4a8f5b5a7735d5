"""/v1/responses on a proxy without nodes (scripted tokens): a Responses request is the chat its input stands for
(the oracle: apply_chat_template of that chat), the response and every stream event validate against the OpenAI SDK's
own pydantic models, and what cannot be honoured is a 400 naming the field."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from engine.types import FinishReason, SamplingParams
from proxy.api.app import create_app
from proxy.api.responses_api import prepare_response
from proxy.api.serving import ProxyState
from proxy.routing.clients import NodeError
from proxy.routing.pd import TokenChunk
from tests.unit.test_openai_api import ScriptedPipeline
from tests.unit.test_tokenize_api import TOOLS_TEMPLATE

EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


class FailingPipeline(ScriptedPipeline):
    """Streams its tokens, then fails as a node that lost the request would."""

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       deadline: float) -> AsyncGenerator[TokenChunk, None]:
        async for chunk in super().generate(request_id, prompt_token_ids, params, deadline):
            if chunk.finish_reason is not None:
                raise NodeError("decode", grpc.StatusCode.DATA_LOSS, "checksum mismatch", retryable=False)
            yield chunk


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def make_state(tokenizer: Any, text: str, finish_reason: FinishReason = FinishReason.STOP,
               pipeline: type[ScriptedPipeline] = ScriptedPipeline) -> ProxyState:
    """A proxy whose every request generates `text`'s tokens, then ends with `finish_reason` (stop: on EOS)."""
    ids = tokenizer.encode(text) + ([tokenizer.eos_token_id] if finish_reason is FinishReason.STOP else [])
    # tools the template cannot render make a long system message (proxy/api/chat_template.py)
    return ProxyState(pipeline(ids, finish_reason=finish_reason), tokenizer, "m", max_model_len=1024)


@pytest.fixture
def state(tokenizer: Any) -> Iterator[ProxyState]:
    state = make_state(tokenizer, "Sunny all day.")
    yield state
    state.close()


def post(state: ProxyState, body: dict[str, Any]) -> httpx.Response:
    async def run() -> httpx.Response:
        app = create_app(state)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as http:
            return await http.post("/v1/responses", json=body)

    return asyncio.run(run())


def stream_events(state: ProxyState, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = post(state, {**body, "stream": True})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in response.text.split("\n\n"):
        if block:
            name, data = block.split("\n")
            event = json.loads(data.removeprefix("data: "))
            assert name == f"event: {event['type']}"
            EVENTS.validate_python(event)  # the SDK's own model of each event type
            events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_input_items_are_the_chat_they_stand_for(tokenizer_dir: Path, tmp_path: Path) -> None:
    """instructions, text parts, an assistant's text with its calls, and the calls' outputs render as the chat."""
    from transformers import AutoTokenizer

    for path in tokenizer_dir.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    template = TOOLS_TEMPLATE.replace("message['content']", "(message['content'] or '') + "
                                      "(message['tool_calls'] | default([]) | tojson)")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    state = ProxyState(ScriptedPipeline([5]), tokenizer, "m")
    body = {"instructions": "Be terse.", "tools": [TOOL], "tool_choice": "none", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text",
                                                                                     "text": "Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking.",
                                                              "annotations": []}]},
        {"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "sunny"}]}
    chat: Any = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "call_a", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "call_a", "content": "sunny"}]
    tools: Any = [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}]
    expected = tokenizer.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True)
    prepared = prepare_response(state, json.dumps(body).encode())
    assert prepared.chat.prompt_text == expected
    assert prepared.chat.prompt_ids == tokenizer.encode(expected, add_special_tokens=False)
    state.close()


def test_a_whole_response_is_the_sdks_response_with_usage(state: ProxyState, tokenizer: Any) -> None:
    response = post(state, {"model": "m", "input": "Weather?", "instructions": "Be terse.", "max_output_tokens": 50,
                            "metadata": {"k": "v"}, "reasoning": {"effort": "low"}})
    assert response.status_code == 200, response.text
    parsed = Response.model_validate(response.json())
    assert parsed.status == "completed" and parsed.id.startswith("resp_") and parsed.output_text == "Sunny all day."
    prompt = tokenizer.apply_chat_template([{"role": "system", "content": "Be terse."},
                                            {"role": "user", "content": "Weather?"}], tokenize=False,
                                           add_generation_prompt=True)
    assert parsed.usage is not None
    assert parsed.usage.input_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert parsed.usage.output_tokens == len(tokenizer.encode("Sunny all day.")) + 1  # and the EOS
    assert parsed.usage.total_tokens == parsed.usage.input_tokens + parsed.usage.output_tokens
    assert parsed.metadata == {"k": "v"} and parsed.max_output_tokens == 50 and parsed.instructions == "Be terse."


def test_running_out_of_tokens_is_an_incomplete_response(tokenizer: Any) -> None:
    state = make_state(tokenizer, "Sunny", FinishReason.LENGTH)
    parsed = Response.model_validate(post(state, {"input": "Weather?", "max_output_tokens": 2}).json())
    assert parsed.status == "incomplete" and parsed.incomplete_details is not None
    (message,) = parsed.output
    assert parsed.incomplete_details.reason == "max_output_tokens"
    assert message.type == "message" and message.status == "incomplete"
    events = stream_events(state, {"input": "Weather?", "max_output_tokens": 2})
    assert events[-1]["type"] == "response.incomplete"
    state.close()


def test_a_stream_says_each_item_in_order_and_ends_with_the_whole_response(state: ProxyState) -> None:
    events = stream_events(state, {"input": "Weather?", "include": ["message.output_text.logprobs"],
                                   "top_logprobs": 2})
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    final = Response.model_validate(events[-1]["response"])
    assert "".join(e["delta"] for e in deltas) == final.output_text == "Sunny all day."
    message = final.output[0]
    assert message.type == "message" and message.id == deltas[0]["item_id"]
    logprobs = message.content[0].logprobs  # type: ignore[union-attr]
    assert logprobs is not None and len(logprobs) == final.usage.output_tokens  # type: ignore[union-attr]
    assert sum(len(e["logprobs"]) for e in deltas) <= len(logprobs)


def test_a_named_function_is_a_function_call_item_streamed_as_argument_deltas(tokenizer: Any) -> None:
    arguments = '{"city": "Paris"}'
    state = make_state(tokenizer, arguments)
    body = {"input": "Weather in Paris?", "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"}}
    whole = Response.model_validate(post(state, body).json())
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {
        "city": "Paris"}
    assert call.call_id.startswith("call_") and call.id is not None and call.id.startswith("fc_")
    events = stream_events(state, body)
    assert "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta") == arguments
    (done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert done["arguments"] == arguments and events[-1]["response"]["output"][0]["id"] == done["item_id"]
    state.close()


def test_a_reasoning_parsers_thinking_is_a_reasoning_item_before_the_message(tokenizer: Any) -> None:
    from settings.chat import ChatSettings

    state = make_state(tokenizer, "<think>Cold front.</think>Snow.")
    state.chat = ChatSettings(reasoning_parser="qwen3")
    events = stream_events(state, {"input": "Weather?", "reasoning": {"effort": "high", "summary": "auto"}})
    final = Response.model_validate(events[-1]["response"])
    reasoning, message = final.output
    assert reasoning.type == "reasoning" and reasoning.summary == [] and reasoning.content is not None
    assert [c.text for c in reasoning.content] == ["Cold front."] and final.output_text == "Snow."
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "Cold front."
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1]
    assert Response.model_validate(post(state, {"input": "Weather?"}).json()).output[0].type == "reasoning"
    state.close()


def test_a_failure_after_the_first_token_ends_the_stream_with_response_failed(tokenizer: Any) -> None:
    state = make_state(tokenizer, "Sunny all day.", pipeline=FailingPipeline)
    events = stream_events(state, {"input": "Weather?"})
    failed = Response.model_validate(events[-1]["response"])
    assert events[-1]["type"] == "response.failed" and failed.status == "failed" and failed.error is not None
    assert "checksum" in failed.error.message and failed.error.code == "server_error"
    state.close()


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "store": True}, "store"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "seed": 3}, "seed"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "x", "top_logprobs": 2}, "top_logprobs"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "tools": [{**TOOL, "defer_loading": True}]}, "tools"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text"),
    ({"input": "x", "text": {"verbosity": "low"}}, "text"),
    ({"input": "x", "reasoning": {"effort": "maximal"}}, "reasoning"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata"),
    ({"input": "x", "max_output_tokens": "many"}, "max_output_tokens"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "top_p": 10**400}, "top_p"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(state: ProxyState, body: dict[str, Any], param: str
                                                           ) -> None:
    response = post(state, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_a_chat_parsers_error_names_the_input_item_and_the_responses_field(state: ProxyState) -> None:
    response = post(state, {"input": [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c",
                                                                         "name": "f", "arguments": "not json"}]})
    message = response.json()["error"]["message"]
    assert response.status_code == 400 and "input[1]" in message and "messages" not in message
    response = post(state, {"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": 5}}})
    message = response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "text" and "text.format" in message, message
