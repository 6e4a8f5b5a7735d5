"""Losing every prefill node (issue 13, defect 4): the proxy marks an unreachable node down at once and the decode
node prefills instead, so requests keep succeeding (with the greedy output of an undisturbed run) rather than
getting 503s until the dead node's registry entry expires. Real processes: Redis, one prefill node, one decode
node, a proxy that discovers them through the registry and one that is given their addresses."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy
from tests.integration.openai_cluster import node_stats, wait_until
from tests.integration.processes import Process, RedisServer, free_port, launch_proxy, node_args, wait_for_proxy

pytestmark = pytest.mark.integration

# distinct, so each has its own oracle output (the proxies disaggregate every request they can: colocate 0)
PROMPTS = [list(range(100 + 40 * i, 140 + 40 * i)) for i in range(4)]
MAX_TOKENS = 8
PROXY_FLAGS = ["--block-size", "4", "--colocate-max-tokens", "0"]


@dataclass
class PrefillLossCluster:
    model: Path
    redis: RedisServer
    prefill: Process
    decode_address: str
    registry_url: str  # the proxy that finds the nodes in the registry
    static_url: str  # the proxy given their addresses
    processes: list[Process] = field(default_factory=list)


@pytest.fixture(scope="module")
def cluster(tiny_model: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefillLossCluster]:
    model = tiny_model("llama")
    log_dir = tmp_path_factory.mktemp("prefill-loss-logs")
    server = RedisServer(log_dir)
    processes: list[Process] = []
    try:
        nodes = {}
        for role in ("prefill", "decode"):  # started together: they load at the same time
            port = free_port()
            # the registrar's default heartbeat and TTL (1 s, 3 s), as deployed
            process = Process(f"{role}_node", [*node_args(model, port), "--node-id", f"{role}-{port}",
                                               "--registry", server.url], log_dir)
            processes.append(process)
            nodes[role] = (process, f"127.0.0.1:{port}")
        for process, _ in nodes.values():
            process.wait_for_line("READY")
        prefill, prefill_address = nodes["prefill"]
        decode_address = nodes["decode"][1]
        registry_proxy, registry_url = launch_proxy(model, None, None, log_dir,
                                                    ["--registry", server.url, *PROXY_FLAGS])
        processes.append(registry_proxy)
        static_proxy, static_url = launch_proxy(model, prefill_address, decode_address, log_dir,
                                                PROXY_FLAGS)
        processes.append(static_proxy)
        wait_for_proxy(registry_proxy, registry_url)
        wait_for_proxy(static_proxy, static_url)
        yield PrefillLossCluster(model, server, prefill, decode_address, registry_url, static_url, processes)
    finally:
        for process in reversed(processes):
            process.stop()
        server.stop()


def complete(url: str, prompt: list[int]) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                     "ignore_eos": True}, timeout=60)


def decisions(url: str) -> Counter[str]:
    counts: Counter[str] = Counter()
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("tandem:pd_decisions_total{"):
            counts["colocated" if 'mode="colocated"' in line else "disaggregated"] += int(float(line.split()[-1]))
    return counts


class Load:
    """Threads sending the prompts in turn to the proxies until stopped; records every answer."""

    def __init__(self, urls: list[str], num_threads: int) -> None:
        self.urls = urls
        self.stop = threading.Event()
        self.results: list[tuple[float, int, int, str]] = []  # (time, prompt index, status, text or error)
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(num_threads)]

    def _run(self, index: int) -> None:
        n = index
        while not self.stop.is_set():
            url, prompt = self.urls[n % len(self.urls)], n % len(PROMPTS)
            n += 1
            try:
                r = complete(url, PROMPTS[prompt])
                text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
                self.results.append((time.monotonic(), prompt, r.status_code, text))
            except httpx.HTTPError as e:
                self.results.append((time.monotonic(), prompt, 0, repr(e)))

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(90)


def test_killing_the_only_prefill_node_moves_prefill_to_the_decode_node_without_errors(
        cluster: PrefillLossCluster) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(cluster.model))
    expected = [tokenizer.decode(t, skip_special_tokens=True) for t in hf_greedy(cluster.model, PROMPTS, MAX_TOKENS)]
    urls = [cluster.registry_url, cluster.static_url]
    for url in urls:  # both proxies see P: the first requests are disaggregated
        wait_until(lambda url=url: complete(url, PROMPTS[0]).status_code == 200 and  # type: ignore[misc]
                   decisions(url)["disaggregated"] > 0, timeout=30)
    colocated_before = {url: decisions(url)["colocated"] for url in urls}

    with Load(urls, num_threads=4) as load:
        wait_until(lambda: len(load.results) >= 8, timeout=60)
        cluster.prefill.stop(signal.SIGKILL)
        killed_at = time.monotonic()
        # past the registry entry's TTL (3 s), the window in which the proxy used to send requests to the dead node
        time.sleep(5.0)
    after = [r for r in load.results if r[0] > killed_at]
    failures = [r for r in load.results if r[2] != 200]
    assert not failures, f"{len(failures)} of {len(load.results)} requests failed, e.g. {failures[:3]}"
    assert len(after) >= 8, f"only {len(after)} requests ran after the kill"
    wrong = [r for r in load.results if r[3] != expected[r[1]]]
    assert not wrong, f"{len(wrong)} outputs differ from the greedy reference, e.g. {wrong[:2]}"
    for url in urls:  # the requests after the kill ran on D alone, routed there directly
        assert decisions(url)["colocated"] > colocated_before[url]
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert health["status"] == "degraded" and health["ready_nodes"] == {"prefill": 0, "decode": 1}
    # nothing leaked on D: every request ended there, every block is back in its pool
    wait_until(lambda: _decode_idle(cluster.decode_address), timeout=10)


def _decode_idle(address: str) -> bool:
    stats = asyncio.run(node_stats(address, "decode"))
    return stats.num_running == 0 and stats.num_waiting == 0 and stats.free_kv_blocks == stats.total_kv_blocks
