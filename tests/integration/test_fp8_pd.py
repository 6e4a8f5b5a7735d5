"""A prefill node and a decode node started with `--kv-cache-dtype fp8`, as separate processes over NIXL: every
request is disaggregated, its FP8 blocks (with the scales inside them) pulled by D, and the completions equal
transformers' greedy tokens with K/V rounded to e4m3 (tests/fixtures/fp8_oracle.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.fp8_oracle import load_fp8_oracle, oracle_greedy, random_prompts
from tests.fixtures.tiny_models import TinyModelFactory
from tests.integration.processes import pd_cluster

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model(tiny_model: TinyModelFactory) -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def fp8_cluster(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with pd_cluster(model, "nixl", tmp_path_factory.mktemp("fp8-logs"), node_flags=["--kv-cache-dtype", "fp8"]) as url:
        yield url


def test_disaggregated_completions_on_fp8_nodes_equal_the_oracle(fp8_cluster: str, model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    prompts = random_prompts(2, seed=7, lengths=(9, 20))
    for prompt, tokens in zip(prompts, oracle_greedy(load_fp8_oracle(model), prompts, 8), strict=True):
        response = httpx.post(f"{fp8_cluster}/v1/completions", timeout=60,
                              json={"prompt": prompt, "max_tokens": len(tokens), "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == tokenizer.decode(tokens, skip_special_tokens=True)
    # D pulled the prompts' blocks, and they were FP8 blocks: 2 KV heads x 2 layers x (K, V) x 80 bytes (4 tokens x
    # 16 e4m3 values, 4 scale bytes, padding), where a float32 block is 1024 bytes
    families = text_string_to_metric_families(httpx.get(f"{fp8_cluster}/metrics", timeout=10).text)
    pulled = sum(sample.value for family in families if family.name == "tandem:kv_transfer_bytes"
                 for sample in family.samples)
    assert pulled == sum(-(-len(prompt) // 4) for prompt in prompts) * 2 * 2 * 2 * 80
