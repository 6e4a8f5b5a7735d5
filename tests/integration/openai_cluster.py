"""A live OpenAI-serving cluster for the integration tests: one prefill node, one decode node and proxies as
processes on loopback, with what the tests ask of them (an SDK client, node stats, /metrics samples)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai

from protos import tandem_pb2 as pb
from protos import tandem_pb2_grpc
from tests.integration.processes import Process, launch_node, launch_proxy, wait_for_proxy

API_KEY = "sk-tandem-test"
CHAT: Any = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]


@dataclass
class Cluster:
    model: Path
    prefill_address: str
    decode_address: str
    url: str  # an open proxy
    guarded_url: str | None  # a proxy with --api-key and --max-num-requests 1, when asked for
    processes: list[Process]

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60, **kwargs)

    def stats(self, role: str) -> pb.StatsResponse:
        return asyncio.run(node_stats(self.prefill_address if role == "prefill" else self.decode_address, role))

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of `name` (on the open proxy) whose labels include `labels`."""
        total = 0.0
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            match = re.fullmatch(r"([^{ ]+)(?:\{(.*)\})? (\S+)", line)
            if line.startswith("#") or match is None or match[1] != name:
                continue
            found = dict(re.findall(r'(\w+)="([^"]*)"', match[2] or ""))
            if all(found.get(k) == v for k, v in labels.items()):
                total += float(match[3])
        return total


async def node_stats(address: str, role: str) -> pb.StatsResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = (tandem_pb2_grpc.PrefillServiceStub if role == "prefill" else tandem_pb2_grpc.DecodeServiceStub)(channel)
        return await stub.Stats(pb.StatsRequest(), timeout=5)


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Polls condition until it holds; TimeoutError after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.05)


@contextlib.contextmanager
def running_cluster(model: Path, log_dir: Path, with_guarded_proxy: bool = True,
                    decode_args: list[str] | None = None, node_args: list[str] | None = None) -> Iterator[Cluster]:
    """P, D and a proxy that disaggregates every request (so the first token, its logprobs and the prefix hit
    come from P); with_guarded_proxy adds one with the router's default (short prompts run on D alone), an API
    key and --max-num-requests 1; decode_args are extra flags of D, node_args of both nodes. Everything is
    stopped on exit."""
    processes: list[Process] = []
    try:
        prefill, prefill_address = launch_node("prefill", model, "nixl", log_dir, node_args)
        processes.append(prefill)
        decode, decode_address = launch_node("decode", model, "nixl", log_dir,
                                             [*(node_args or []), *(decode_args or [])])
        processes.append(decode)
        for node in (prefill, decode):
            node.wait_for_line("READY")
        # the proxies start once both nodes serve, as they would find a running cluster
        proxy, url = launch_proxy(model, prefill_address, decode_address, log_dir,
                                  ["--block-size", "4", "--colocate-max-tokens", "0"])
        processes.append(proxy)
        proxies = [(proxy, url)]
        guarded_url = None
        if with_guarded_proxy:
            guarded, guarded_url = launch_proxy(model, prefill_address, decode_address, log_dir,
                                                ["--block-size", "4", "--api-key", API_KEY, "--max-num-requests", "1"])
            processes.append(guarded)
            proxies.append((guarded, guarded_url))
        for process, process_url in proxies:
            wait_for_proxy(process, process_url)
        yield Cluster(model, prefill_address, decode_address, url, guarded_url, processes)
    finally:
        for process in reversed(processes):
            process.stop()


def all_resources_free(cluster: Cluster) -> bool:
    """No request running or waiting on D, no ticket pinned on P, every KV block of both back in its pool."""
    p, d = cluster.stats("prefill"), cluster.stats("decode")
    return (d.num_running == 0 and d.num_waiting == 0 and p.num_pinned_tickets == 0
            and p.free_kv_blocks == p.total_kv_blocks and d.free_kv_blocks == d.total_kv_blocks)
