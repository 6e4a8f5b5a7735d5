"""`tool_choice: "auto"` and reasoning through a real cluster with the OpenAI SDK, on a model trained to write the
hermes call format and Qwen3's `<think>` blocks (tests/fixtures/tool_model.py). The expected answers are its
training targets, which the fixture checked transformers' greedy `generate` writes; the parsers' split of them
follows vLLM's documented rules. Each request goes through a proxy that disaggregates every request and one that
colocates every request on the decode node; a proxy started without `--enable-auto-tool-choice` refuses `auto`."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.fixtures.tool_model import (
    ANSWERS_FROM_TOOL,
    ANSWERS_WITHOUT_THINKING,
    CALLS_WEATHER,
    REASONS,
    SAYS_HELLO,
    WEATHER_ARGUMENTS,
    WEATHER_RESULT,
    WEATHER_TOOL,
    Conversation,
)
from tests.integration.processes import Process, launch_node, launch_proxy, wait_for_proxy

pytestmark = pytest.mark.integration

ROUTES = ("disaggregated", "colocated")
PARSERS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
# --colocate-max-tokens 0 sends every request through P; a limit above every prompt here keeps each on an idle D
ROUTE_FLAGS = {"disaggregated": ["--colocate-max-tokens", "0"], "colocated": ["--colocate-max-tokens", "100000"]}
MAX_TOKENS = 48  # more than any target needs: each ends on EOS


@dataclass(frozen=True)
class Servers:
    model: Path
    urls: dict[str, str]  # route -> a proxy with the parsers
    plain_url: str  # a proxy without --enable-auto-tool-choice or parsers (the router's default)

    def client(self, route: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.urls[route]}/v1", api_key="unused", max_retries=0, timeout=60)

    def decisions(self, route: str, mode: str) -> float:
        """tandem:pd_decisions_total{mode} on the proxy of `route`."""
        text = httpx.get(f"{self.urls[route]}/metrics", timeout=10).text
        return sum(float(m[1]) for m in re.finditer(rf'^tandem:pd_decisions_total{{[^}}]*mode="{mode}"[^}}]*}} (\S+)$',
                                                    text, re.MULTILINE))


@pytest.fixture(scope="module")
def servers(tool_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    log_dir = tmp_path_factory.mktemp("tool-choice-auto-logs")
    processes: list[Process] = []
    try:
        # the tools' system turn makes prompts of ~220 tokens: room for several in flight and cached
        prefill, prefill_address = launch_node("prefill", tool_model, "nixl", log_dir, ["--num-kv-blocks", "512"])
        processes.append(prefill)
        decode, decode_address = launch_node("decode", tool_model, "nixl", log_dir, ["--num-kv-blocks", "512"])
        processes.append(decode)
        for node in (prefill, decode):
            node.wait_for_line("READY")
        urls: dict[str, str] = {}
        proxies = []
        for route in ROUTES:
            proxy, urls[route] = launch_proxy(tool_model, prefill_address, decode_address, log_dir,
                                              [*PARSERS, "--block-size", "4", *ROUTE_FLAGS[route]])
            proxies.append((proxy, urls[route]))
        plain, plain_url = launch_proxy(tool_model, prefill_address, decode_address, log_dir, ["--block-size", "4"])
        proxies.append((plain, plain_url))
        processes += [proxy for proxy, _ in proxies]
        for proxy, url in proxies:
            wait_for_proxy(proxy, url)
        yield Servers(tool_model, urls, plain_url)
    finally:
        for process in reversed(processes):
            with contextlib.suppress(Exception):
                process.stop()


@pytest.fixture(scope="module")
def tokenizer(servers: Servers) -> Any:
    return AutoTokenizer.from_pretrained(str(servers.model))


def request(servers: Servers, conversation: Conversation, **overrides: Any) -> dict[str, Any]:
    """The chat request of a trained conversation, greedy."""
    body: dict[str, Any] = {"model": servers.model.name, "messages": conversation.messages, "temperature": 0,
                            "max_tokens": MAX_TOKENS}
    if conversation.tools is not None:
        body |= {"tools": conversation.tools, "tool_choice": "auto"}
    if conversation.template_kwargs:
        body["extra_body"] = {"chat_template_kwargs": conversation.template_kwargs}
    return body | overrides


def num_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def think_split(target: str) -> tuple[str, str]:
    """(reasoning, content) of an output, by vLLM's rule: what lies between `<think>` and `</think>`, and what
    follows, neither stripped."""
    _, _, rest = target.partition("<think>")
    reasoning, _, content = rest.partition("</think>")
    return reasoning, content


@pytest.mark.parametrize("route", ROUTES)
def test_auto_returns_the_trained_call_as_tool_calls(servers: Servers, tokenizer: Any, route: str) -> None:
    chat = servers.client(route).chat.completions.create(**request(servers, CALLS_WEATHER))
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content in (None, "")
    (call,) = choice.message.tool_calls or []
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == WEATHER_ARGUMENTS
    # the proxy rendered the prompt the model was trained on, and counts EOS as vLLM does
    assert chat.usage is not None
    assert chat.usage.prompt_tokens == num_tokens(tokenizer, CALLS_WEATHER.prompt(tokenizer))
    assert chat.usage.completion_tokens == num_tokens(tokenizer, CALLS_WEATHER.target) + 1
    # and took the route it stands for
    other = "colocated" if route == "disaggregated" else "disaggregated"
    assert servers.decisions(route, route) >= 1 and servers.decisions(route, other) == 0


@pytest.mark.parametrize("route", ROUTES)
def test_auto_streams_the_call_in_openai_pieces_with_usage_once(servers: Servers, route: str) -> None:
    client = servers.client(route)
    whole = client.chat.completions.create(**request(servers, CALLS_WEATHER))
    (whole_call,) = whole.choices[0].message.tool_calls or []

    chunks = list(client.chat.completions.create(**request(servers, CALLS_WEATHER), stream=True,
                                                 stream_options={"include_usage": True}))
    *pieces, last = chunks
    assert last.choices == [] and last.usage is not None and all(c.usage is None for c in pieces)
    assert last.usage.model_dump() == (whole.usage.model_dump() if whole.usage else None)
    deltas = [c.choices[0].delta for c in pieces if c.choices]
    call_pieces = [piece for d in deltas for piece in d.tool_calls or []]
    first, *rest = call_pieces
    assert first.index == 0 and first.id is not None and first.id.startswith("call_") and first.type == "function"
    assert first.function is not None and first.function.name == "get_weather"
    assert all(p.index == 0 and p.id is None and p.function is not None and p.function.name is None for p in rest)
    assert "".join(p.function.arguments or "" for p in call_pieces if p.function) == whole_call.function.arguments
    assert "".join(d.content or "" for d in deltas) == ""
    assert [c.choices[0].finish_reason for c in pieces if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_the_sdks_stream_helper_accumulates_the_call(servers: Servers) -> None:
    # the helper parses strict tools only; `strict` does not reach the template, so the prompt is the trained one
    strict_tool = {**WEATHER_TOOL, "function": {**WEATHER_TOOL["function"], "strict": True}}
    with servers.client("disaggregated").chat.completions.stream(
            **request(servers, CALLS_WEATHER, tools=[strict_tool]), stream_options={"include_usage": True}
    ) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    (done,) = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert done.name == "get_weather" and done.parsed_arguments == WEATHER_ARGUMENTS
    # the opening chunk's "content": "" (vLLM's too) is the one content event, and it adds nothing
    assert all(e.delta == "" for e in events if e.type == "content.delta")
    (call,) = final.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather" and call.function.parsed_arguments == WEATHER_ARGUMENTS
    assert final.choices[0].finish_reason == "tool_calls" and final.usage is not None


def test_auto_with_parallel_tool_calls_false_returns_the_one_call(servers: Servers) -> None:
    chat = servers.client("disaggregated").chat.completions.create(
        **request(servers, CALLS_WEATHER, parallel_tool_calls=False))
    (call,) = chat.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == WEATHER_ARGUMENTS
    assert chat.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("route", ROUTES)
def test_auto_answers_in_text_when_the_model_calls_nothing(servers: Servers, route: str) -> None:
    chat = servers.client(route).chat.completions.create(**request(servers, SAYS_HELLO))
    choice = chat.choices[0]
    assert choice.message.content == SAYS_HELLO.target and not choice.message.tool_calls
    assert choice.finish_reason == "stop"


@pytest.mark.parametrize("route", ROUTES)
def test_reasoning_is_split_from_the_answer_whole_and_streamed(servers: Servers, route: str) -> None:
    reasoning, content = think_split(REASONS.target)
    assert (reasoning, content) == ("\nTwo plus two is four.\n", "\n\nThe answer is 4.")
    client = servers.client(route)
    chat = client.chat.completions.create(**request(servers, REASONS))
    message = chat.choices[0].message
    assert getattr(message, "reasoning_content", None) == reasoning and message.content == content
    assert chat.choices[0].finish_reason == "stop"

    kinds: list[str] = []  # "reasoning" or "content", per delta that carries text
    texts = {"reasoning": "", "content": ""}
    for chunk in client.chat.completions.create(**request(servers, REASONS), stream=True):
        delta = chunk.choices[0].delta
        for kind, text in (("reasoning", getattr(delta, "reasoning_content", None)), ("content", delta.content)):
            if text:
                kinds.append(kind)
                texts[kind] += text
    assert texts == {"reasoning": reasoning, "content": content}
    assert kinds == sorted(kinds, key=["reasoning", "content"].index)  # all the reasoning, then the answer


def test_enable_thinking_false_renders_an_empty_think_block_and_answers_in_content(servers: Servers,
                                                                                  tokenizer: Any) -> None:
    client = servers.client("disaggregated")
    chat = client.chat.completions.create(**request(servers, ANSWERS_WITHOUT_THINKING))
    prompt = ANSWERS_WITHOUT_THINKING.prompt(tokenizer)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert chat.usage is not None and chat.usage.prompt_tokens == num_tokens(tokenizer, prompt)
    assert chat.usage.prompt_tokens != num_tokens(tokenizer, REASONS.prompt(tokenizer))
    message = chat.choices[0].message
    assert message.content == ANSWERS_WITHOUT_THINKING.target
    assert getattr(message, "reasoning_content", None) is None


@pytest.mark.parametrize("route", ROUTES)
def test_a_tool_result_sent_back_gets_the_trained_answer(servers: Servers, route: str) -> None:
    client = servers.client(route)
    first = client.chat.completions.create(**request(servers, CALLS_WEATHER))
    calls = first.choices[0].message.tool_calls or []
    assert len(calls) == 1
    messages = [*CALLS_WEATHER.messages,
                {"role": "assistant", "content": first.choices[0].message.content,
                 "tool_calls": [call.model_dump(include={"id", "type", "function"}) for call in calls]},
                {"role": "tool", "tool_call_id": calls[0].id, "content": WEATHER_RESULT}]
    second = client.chat.completions.create(**request(servers, ANSWERS_FROM_TOOL, messages=messages))
    assert second.choices[0].message.content == ANSWERS_FROM_TOOL.target
    assert not second.choices[0].message.tool_calls and second.choices[0].finish_reason == "stop"


def test_auto_on_a_proxy_without_enable_auto_tool_choice_is_a_400_naming_tool_choice(servers: Servers) -> None:
    client = openai.OpenAI(base_url=f"{servers.plain_url}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**request(servers, CALLS_WEATHER))
    assert "tool_choice" in str(refused.value)
    body: Any = refused.value.body
    assert isinstance(body, dict) and body.get("param") == "tool_choice"
