"""Prefill/decode handoff across tensor-parallel sizes (NIXL, loopback, float32): a prefill node of two ranks hands
its KV to a decode node of one, and one of one rank to a decode node of two, through the proxy and directly;
the tokens equal transformers' greedy tokens, and the decode side pulled exactly the prompt's bytes."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy
from tests.integration.processes import Process, free_port, launch_proxy, node_args, wait_for_proxy
from tests.integration.test_pd_e2e import _generate, _greedy, _prefill, _stats, prompts

pytestmark = pytest.mark.integration

# (prefill TP, decode TP) pairs; the tiny Llama has 2 KV heads: one per rank of a TP=2 node
PAIRS = [(2, 1), (1, 2)]


class Pair:
    def __init__(self, prefill: str, decode: str, url: str) -> None:
        self.prefill, self.decode, self.url = prefill, decode, url


@pytest.fixture(scope="module")
def pairs(tiny_model: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[int, int],
                                                                                                  Pair]]:
    model = tiny_model("llama")
    log_dir = tmp_path_factory.mktemp("logs-tp")
    processes: list[Process] = []
    try:
        addresses: dict[tuple[str, int], str] = {}
        started = []
        for role, tp in {("prefill", p) for p, _ in PAIRS} | {("decode", d) for _, d in PAIRS}:
            port = free_port()
            process = Process(f"{role}_node", [*node_args(model, port), "--tp", str(tp)], log_dir)
            processes.append(process)
            started.append(process)
            addresses[(role, tp)] = f"127.0.0.1:{port}"
        for process in started:  # the four nodes start side by side
            process.wait_for_line("READY", timeout=150)
        out = {}
        proxies = []
        for p, d in PAIRS:  # the proxies start side by side too
            proxy, url = launch_proxy(model, addresses[("prefill", p)], addresses[("decode", d)], log_dir,
                                      ["--colocate-max-tokens", "0"])
            processes.append(proxy)
            proxies.append((proxy, url))
            out[(p, d)] = Pair(addresses[("prefill", p)], addresses[("decode", d)], url)
        for proxy, url in proxies:
            wait_for_proxy(proxy, url)
        yield out
    finally:
        for process in processes:  # all at once: each drains and stops its worker ranks
            if process.alive:
                os.killpg(process.popen.pid, signal.SIGTERM)
        for process in reversed(processes):
            process.stop()


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), PAIRS)
def test_a_decode_node_of_another_tp_size_continues_the_prompt_token_for_token(
        pairs: dict[tuple[int, int], Pair], tiny_model: TinyModelFactory, prefill_tp: int, decode_tp: int) -> None:
    pair = pairs[(prefill_tp, decode_tp)]
    model: Path = tiny_model("llama")
    # 13 tokens: 4 blocks of 4, the last one partial
    prompt = prompts(1, 13, seed=prefill_tp * 10 + decode_tp)[0]
    expected = hf_greedy(model, [prompt], 8)[0]
    before = asyncio.run(_stats(pair.decode, "decode"))

    prefilled = asyncio.run(_prefill(pair.prefill, prompt, _greedy(8)))
    assert prefilled.first_token == expected[0]
    assert asyncio.run(_generate(pair.decode, prompt, prefilled, _greedy(8))) == expected[1:]

    after = asyncio.run(_stats(pair.decode, "decode"))
    # the pull moved the prompt's 4 blocks of every KV head once: layers x (K, V) x block_size x heads x head_dim x 4 B
    block_bytes = 2 * 2 * 4 * 2 * 16 * 4
    assert after.kv_transfer_bytes - before.kv_transfer_bytes == 4 * block_bytes
    assert after.free_kv_blocks == after.total_kv_blocks


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), PAIRS)
def test_the_proxy_serves_a_cluster_of_mixed_tp_sizes(pairs: dict[tuple[int, int], Pair],
                                                      tiny_model: TinyModelFactory, prefill_tp: int,
                                                      decode_tp: int) -> None:
    from transformers import AutoTokenizer

    model = tiny_model("llama")
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    prompt = prompts(1, 9, seed=prefill_tp)[0]
    expected = hf_greedy(model, [prompt], 10)[0]
    r = httpx.post(f"{pairs[(prefill_tp, decode_tp)].url}/v1/completions",
                   json={"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
