"""A Tandem cluster spread over four hosts (tests/multihost/hosts.py), for faults only a network has:

    host 0  redis-server, the proxy (--registry), the clients (threads in its namespace), a Stats agent
    host 1  prefill-1        host 2  decode-2        host 3  decode-3

The nodes register in host 0's Redis and the proxy finds them there; every node keeps its host and port across
restarts. The proxy disaggregates every request (--colocate-max-tokens 0) round robin, with the fault suite's short
health checks and deadlines (tests/reliability/harness.py), whose clients and outcome kinds this cluster reuses:
`stream_once` needs only `url` and `expected_text`.

Node Stats are read over gRPC by an agent process on host 0 (`python -m tests.multihost.cluster AGENT_ADDRESS`),
asked over HTTP from host 0's namespace: gRPC in this process would connect from its own threads, which need not be
in host 0's namespace (and share subchannels across namespaces), so its calls could leave from the wrong host.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import httpx

from tests.multihost.hosts import Host, Hosts, host_environment
from tests.reliability.harness import HUNG_MARGIN_S, ClientBehaviour, Kind, Outcome, stream_once, wait_for

ROOT = Path(__file__).resolve().parents[2]
# each host is a network namespace of its own: nothing else can hold these ports
REDIS_PORT, NODE_PORT, PROXY_PORT, AGENT_PORT = 6379, 7000, 8000, 9000
BLOCK_SIZE = 4
REQUEST_TIMEOUT_S = 15.0  # the proxy's deadline for every request
LEASE_S = 3.0  # the prefill node's lease
REGISTRY_TTL_S = 2.0
PROXY_FLAGS = ["--block-size", str(BLOCK_SIZE), "--routing", "round_robin", "--colocate-max-tokens", "0",
               "--health-check-interval", "0.25", "--health-check-timeout", "1.0", "--prefill-attempt-timeout", "5",
               "--decode-first-token-timeout", "5", "--request-timeout", str(REQUEST_TIMEOUT_S)]
NODE_FLAGS = ["--dtype", "float32", "--kv-backend", "nixl", "--block-size", str(BLOCK_SIZE), "--num-kv-blocks",
              "128", "--max-num-seqs", "8", "--heartbeat-seconds", "0.5", "--registry-ttl-seconds",
              str(REGISTRY_TTL_S), "--log-level", "WARNING"]
NODE_HOSTS = {"prefill-1": 1, "decode-2": 2, "decode-3": 3}  # node name -> the index of its host
FULL_STRENGTH = {"prefill": 1, "decode": 2}
STATS_FIELDS = ("free_kv_blocks", "total_kv_blocks", "num_running", "num_waiting", "num_pinned_tickets",
                "kv_transfer_count")


@dataclass
class Node:
    name: str  # "decode-2"
    host: Host
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    num_starts: int = 0

    @property
    def role(self) -> str:
        return self.name.split("-")[0]

    @property
    def address(self) -> str:
        return f"{self.host.ip}:{NODE_PORT}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path is not None and self.log_path.exists() else ""


@dataclass
class SpreadCluster:
    hosts: Hosts
    model: Path
    log_dir: Path
    references: dict[tuple[int, ...], list[int]]  # prompt -> its greedy tokens (transformers')
    tokenizer: Any
    nodes: dict[str, Node] = field(default_factory=dict)

    @property
    def front(self) -> Host:
        """Host 0: Redis, the proxy, the clients."""
        return self.hosts[0]

    @property
    def url(self) -> str:
        return f"http://{self.front.ip}:{PROXY_PORT}"

    @property
    def registry(self) -> str:
        return f"redis://{self.front.ip}:{REDIS_PORT}/0"

    def expected_text(self, prompt: list[int], max_tokens: int) -> str:
        return str(self.tokenizer.decode(self.references[tuple(prompt)][:max_tokens], skip_special_tokens=True))

    # -- processes -------------------------------------------------------------------------------------------------
    def start_front(self) -> None:
        """Redis and the Stats agent on host 0 (the proxy once nodes are up: `start_proxy`)."""
        self.front.run(["redis-server", "--bind", self.front.ip, "--port", str(REDIS_PORT), "--save", "",
                        "--appendonly", "no", "--protected-mode", "no", "--dir", str(self.log_dir)],
                       log_path=self.log_dir / "redis.log")
        self.front.run([sys.executable, "-m", "tests.multihost.cluster", f"{self.front.ip}:{AGENT_PORT}"],
                       env=host_environment(), log_path=self.log_dir / "stats-agent.log", cwd=ROOT)

    def start_proxy(self) -> None:
        self.front.run([sys.executable, "-m", "proxy", "--model", str(self.model), "--registry", self.registry,
                        "--host", self.front.ip, "--port", str(PROXY_PORT), "--log-level", "warning", *PROXY_FLAGS],
                       env=host_environment(), log_path=self.log_dir / "proxy.log", cwd=ROOT)

    def start_node(self, name: str) -> None:
        """Starts the node on its host (a log of its own per start); `wait_ready` waits for it."""
        node = self.nodes.setdefault(name, Node(name, self.hosts[NODE_HOSTS[name]]))
        node.num_starts += 1
        node.log_path = self.log_dir / f"{name}-{node.num_starts}.log"
        extra = ["--lease-seconds", str(LEASE_S)] if node.role == "prefill" else []
        node.process = node.host.run(
            [sys.executable, "-m", f"{node.role}_node", "--model", str(self.model), "--host", node.host.ip,
             "--port", str(NODE_PORT), "--ucx-devices", node.host.device, "--node-id", name, "--registry",
             self.registry, *NODE_FLAGS, *extra], env=host_environment(), log_path=node.log_path, cwd=ROOT)

    def wait_ready(self, name: str, timeout: float = 120.0) -> None:
        node = self.nodes[name]
        deadline = time.monotonic() + timeout
        while "READY" not in node.log():
            if not node.alive:
                raise RuntimeError(f"{name} exited:\n{node.log()[-4000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not READY in {timeout} s:\n{node.log()[-4000:]}")
            time.sleep(0.1)

    def restore(self, timeout: float = 120.0) -> float:
        """Back to full strength: every link up and unshaped, every dead node started again, and the proxy seeing
        all three nodes ready; then a burst (one request per decode node, round robin) must succeed. Returns the
        seconds it took until the proxy saw them all."""
        started = time.monotonic()
        for host in self.hosts:
            host.unshape()
            host.restore()
        dead = [name for name, node in self.nodes.items() if not node.alive]
        for name in dead:
            self.start_node(name)
        for name in dead:
            self.wait_ready(name, timeout)
        wait_for(lambda: self.ready_nodes() == FULL_STRENGTH, timeout, "all nodes ready at the proxy")
        ready_s = time.monotonic() - started
        for outcome in self.burst(list(self.references)[:2]):
            assert outcome.kind is Kind.OK, f"the restored cluster failed a request: {outcome}"
        return ready_s

    # -- clients, all on host 0 ------------------------------------------------------------------------------------
    def stream(self, prompt: list[int], max_tokens: int, rng: random.Random) -> Outcome:
        """One greedy streaming completion from host 0, classified (tests/reliability/harness.py)."""
        return self.front.call(stream_once, self, prompt, ClientBehaviour(max_tokens), rng,
                               timeout=REQUEST_TIMEOUT_S + 3 * HUNG_MARGIN_S)

    def burst(self, prompts: list[tuple[int, ...]], max_tokens: int = 12) -> list[Outcome]:
        results: list[Outcome] = []

        def one(i: int) -> None:
            results.append(self.stream(list(prompts[i]), max_tokens, random.Random(i)))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return results

    def _get(self, url: str) -> httpx.Response:
        return self.front.call(lambda: httpx.get(url, timeout=3), timeout=10)

    def ready_nodes(self) -> dict[str, int]:
        """The nodes ready by role in the proxy's view."""
        try:
            return dict(self._get(f"{self.url}/health").json().get("ready_nodes", {}))
        except (httpx.HTTPError, ValueError):
            return {}

    def metric(self, name: str, **labels: str) -> float:
        total = 0.0
        for line in self._get(f"{self.url}/metrics").text.splitlines():
            metric, _, value = line.rpartition(" ")
            base, _, label_text = metric.partition("{")
            if base == name and all(f'{k}="{v}"' in label_text for k, v in labels.items()):
                total += float(value)
        return total

    # -- what the nodes say ----------------------------------------------------------------------------------------
    def stats(self, name: str) -> dict[str, int] | None:
        """The node's Stats (STATS_FIELDS), None when it does not answer."""
        node = self.nodes[name]
        try:
            response = self._get(f"http://{self.front.ip}:{AGENT_PORT}/stats?role={node.role}&address={node.address}")
        except httpx.HTTPError:
            return None
        return response.json() if response.status_code == 200 else None  # type: ignore[no-any-return]

    def busy(self, name: str, min_running: int = 0) -> bool:
        stats = self.stats(name)
        if stats is None:
            return False
        return stats["num_running"] >= min_running if min_running else stats["num_running"] + stats["num_waiting"] > 0

    def wait_busy(self, name: str, min_running: int = 0, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while not self.busy(name, min_running):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def leaked_blocks(self, timeout: float) -> dict[str, int]:
        """Once load has stopped: KV blocks still taken on each live node, plus requests still there and tickets
        still pinned (-1: a live node that does not answer), once all are idle or `timeout` has passed."""
        deadline = time.monotonic() + timeout
        while True:
            leaked = {}
            for name, node in self.nodes.items():
                if not node.alive:
                    continue
                stats = self.stats(name)
                leaked[name] = -1 if stats is None else (
                    stats["total_kv_blocks"] - stats["free_kv_blocks"] + stats["num_running"] + stats["num_waiting"]
                    + stats["num_pinned_tickets"])
            if not any(leaked.values()) or time.monotonic() > deadline:
                return leaked
            time.sleep(0.2)


class Load:
    """`num_clients` threads streaming one request after another (seeded prompt order) from host 0 until stopped."""

    def __init__(self, cluster: SpreadCluster, num_clients: int, max_tokens: int, seed: int,
                 prompts: list[tuple[int, ...]]) -> None:
        self.cluster, self.max_tokens, self.prompts = cluster, max_tokens, prompts
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(random.Random(seed * 1000 + i),), daemon=True)
                         for i in range(num_clients)]

    def _run(self, rng: random.Random) -> None:
        while not self._stop.is_set():
            self.outcomes.append(self.cluster.stream(list(rng.choice(self.prompts)), self.max_tokens, rng))

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(REQUEST_TIMEOUT_S + 3 * HUNG_MARGIN_S)
        assert not any(t.is_alive() for t in self._threads), "a client thread outlived its request's hung margin"

    def wait_for_answers(self, count: int, timeout: float = 60.0) -> None:
        wait_for(lambda: len(self.outcomes) >= count, timeout, f"{count} answers")


def poll_while(action: Callable[[], None], probe: Callable[[], Any], interval: float = 0.2) -> list[Any]:
    """Runs `action` while `probe()` is sampled every `interval` on another thread; returns the samples."""
    samples: list[Any] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append(probe())
            done.wait(interval)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        action()
    finally:
        done.set()
        thread.join(10)
    return samples


# -- the Stats agent (runs on host 0) ----------------------------------------------------------------------------------
def _stats(role: str, address: str) -> dict[str, int] | None:
    import grpc

    from protos import tandem_pb2 as pb
    from protos import tandem_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = (tandem_pb2_grpc.PrefillServiceStub if role == "prefill" else tandem_pb2_grpc.DecodeServiceStub)(channel)
        try:
            response = stub.Stats(pb.StatsRequest(), timeout=2.0)
        except grpc.RpcError:
            return None
    return {name: int(getattr(response, name)) for name in STATS_FIELDS}


class _StatsHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        query = parse_qs(urlparse(self.path).query)
        stats = _stats(query["role"][0], query["address"][0])
        body = json.dumps(stats).encode()
        self.send_response(200 if stats is not None else 503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description="answers GET /stats?role=R&address=H:P with a node's Stats as JSON")
    parser.add_argument("address", help="HOST:PORT to listen on")
    host, _, port = parser.parse_args().address.rpartition(":")
    ThreadingHTTPServer((host, int(port)), _StatsHandler).serve_forever()


if __name__ == "__main__":
    main()
