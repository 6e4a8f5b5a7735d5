"""Requests already sent to a frozen node do not stay there (issue 13, defect 3). A node stopped with SIGSTOP
answers nothing, not even its health checks: the proxy gives it up after two failed checks and retries the
requests in flight there on another node, long before their deadline, with the greedy output of an undisturbed
run. Once the node thaws (SIGCONT) the requests it was given are aborted there: no KV block stays taken.

Real processes: two prefill and two decode nodes, and a proxy that checks their health every 0.25 s and routes
round robin (so that half of a burst of requests lands on the frozen node, deterministically)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy
from tests.integration.openai_cluster import node_stats, wait_until
from tests.integration.processes import Process, free_port, node_args, start_proxy

pytestmark = pytest.mark.integration

# distinct prompts, each with its own oracle output
PROMPTS = [list(range(100 + 40 * i, 140 + 40 * i)) for i in range(4)]
MAX_TOKENS = 8
REQUEST_TIMEOUT_S = 60  # the proxy's deadline (start_proxy's --request-timeout)
BOUND_S = 10.0  # what a request may take with a frozen node in the cluster (it used to wait for the deadline)
CLIENT_TIMEOUT_S = 20.0  # past the bound: a request still waiting then has failed the test anyway
PROXY_FLAGS = ["--block-size", "4", "--routing", "round_robin", "--health-check-interval", "0.25",
               "--health-check-timeout", "1.0"]


@dataclass
class FrozenCluster:
    model: Path
    nodes: dict[str, tuple[Process, str]]  # "prefill-0" -> (process, address)
    url: str
    expected: list[str]  # the greedy text of each prompt (transformers)


@pytest.fixture(scope="module")
def cluster(tiny_model: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FrozenCluster]:
    from transformers import AutoTokenizer

    model = tiny_model("llama")
    log_dir = tmp_path_factory.mktemp("frozen-nodes-logs")
    processes: list[Process] = []
    try:
        nodes = {}
        for role in ("prefill", "decode"):
            for i in range(2):  # started together: they load at the same time
                port = free_port()
                process = Process(f"{role}_node", node_args(model, port), log_dir)
                processes.append(process)
                nodes[f"{role}-{i}"] = (process, f"127.0.0.1:{port}")
        for process, _ in nodes.values():
            process.wait_for_line("READY")
        listed = [arg for name, (_, address) in nodes.items() for arg in (f"--{name.split('-')[0]}", address)]
        proxy, url = start_proxy(model, None, None, log_dir, [*listed, *PROXY_FLAGS])
        processes.append(proxy)
        tokenizer = AutoTokenizer.from_pretrained(str(model))
        expected = [tokenizer.decode(t, skip_special_tokens=True) for t in hf_greedy(model, PROMPTS, MAX_TOKENS)]
        yield FrozenCluster(model, nodes, url, expected)
    finally:
        for process in reversed(processes):
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.popen.pid, signal.SIGCONT)
            process.stop()


def complete(url: str, prompt: list[int]) -> tuple[float, int, str]:
    """(seconds taken, HTTP status, text or error) of one greedy completion."""
    started = time.monotonic()
    try:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                      "ignore_eos": True}, timeout=CLIENT_TIMEOUT_S)
    except httpx.HTTPError as e:
        return time.monotonic() - started, 0, repr(e)
    return time.monotonic() - started, r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text


def burst(url: str) -> list[tuple[float, int, str]]:
    """Every prompt at once."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda prompt: complete(url, prompt), PROMPTS))


def metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        match = re.fullmatch(r"([^{ ]+)(?:\{(.*)\})? (\S+)", line)
        if match and match[1] == name and all(f'{k}="{v}"' in (match[2] or "") for k, v in labels.items()):
            total += float(match[3])
    return total


def all_nodes_serving(cluster: FrozenCluster) -> None:
    """Every node healthy in the proxy's view and serving (after a thaw: out of its dead-node back-off too)."""
    def ready() -> bool:
        health = httpx.get(f"{cluster.url}/health", timeout=5).json()
        return bool(health["ready_nodes"] == {"prefill": 2, "decode": 2})

    wait_until(ready, timeout=30)
    for _, status, text in burst(cluster.url):  # round robin: every node takes one
        assert status == 200, text


@contextlib.contextmanager
def frozen(process: Process) -> Iterator[None]:
    os.kill(process.popen.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(process.popen.pid, signal.SIGCONT)


def idle_with_every_block_free(address: str, role: str) -> bool:
    stats = asyncio.run(node_stats(address, role))
    return (stats.num_running == 0 and stats.num_waiting == 0 and stats.num_pinned_tickets == 0
            and stats.free_kv_blocks == stats.total_kv_blocks)


def check_burst(cluster: FrozenCluster, results: list[tuple[float, int, str]]) -> None:
    failed = [r for r in results if r[1] != 200]
    assert not failed, f"{len(failed)} of {len(results)} requests failed: {failed}"
    slow = [r[0] for r in results if r[0] >= BOUND_S]
    assert not slow, f"requests took {slow} s with a frozen node (deadline {REQUEST_TIMEOUT_S} s)"
    assert [r[2] for r in results] == cluster.expected, "outputs differ from the greedy reference"


def test_requests_sent_to_a_frozen_prefill_node_complete_on_the_other_one_and_the_node_frees_all_after_a_thaw(
        cluster: FrozenCluster) -> None:
    all_nodes_serving(cluster)
    process, address = cluster.nodes["prefill-0"]
    abandoned = metric(cluster.url, "tandem:attempts_abandoned_total", role="prefill", reason="node_lost")
    with frozen(process):
        results = burst(cluster.url)  # half of them are sent to the frozen node before the proxy notices
        check_burst(cluster, results)
        assert metric(cluster.url, "tandem:attempts_abandoned_total", role="prefill",
                      reason="node_lost") >= abandoned + 1
        assert metric(cluster.url, "tandem:request_retries_total", role="prefill") >= 1
    # thawed: it sees the cancelled Prefills (and the proxy's aborts) and frees every block it took for them
    wait_until(lambda: idle_with_every_block_free(address, "prefill"), timeout=10)
    for name, (_, other) in cluster.nodes.items():
        wait_until(lambda other=other, name=name: idle_with_every_block_free(other, name.split("-")[0]),
                   timeout=10)


def test_requests_sent_to_a_frozen_decode_node_before_it_streams_complete_on_the_other_one(
        cluster: FrozenCluster) -> None:
    all_nodes_serving(cluster)
    process, address = cluster.nodes["decode-0"]
    abandoned = metric(cluster.url, "tandem:attempts_abandoned_total", role="decode", reason="node_lost")
    with frozen(process):
        results = burst(cluster.url)  # half of them are handed to the frozen node, which streams nothing
        check_burst(cluster, results)
        assert metric(cluster.url, "tandem:attempts_abandoned_total", role="decode",
                      reason="node_lost") >= abandoned + 1
    wait_until(lambda: idle_with_every_block_free(address, "decode"), timeout=10)
    for name, (_, other) in cluster.nodes.items():  # the tickets of the abandoned handoffs were released
        wait_until(lambda other=other, name=name: idle_with_every_block_free(other, name.split("-")[0]),
                   timeout=10)
