"""`tandem serve` as a user runs it: a real local Ray, redis-server, node and proxy processes on loopback.

One cluster for the module (starting one costs most of the time): it answers OpenAI requests, `tandem status`
finds it through the state file, and the decode pool scales up and back down while streaming requests run,
with none failing. Every test leaves that cluster as it found it (one prefill and one decode node), so each passes
alone and in any order: the test that kills a node kills one it added, and the test that stops `tandem serve`
stops a cluster of its own.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from protos import tandem_pb2 as pb
from protos import tandem_pb2_grpc
from tests.fixtures.tiny_models import TinyModelFactory
from tests.integration.processes import ROOT, free_port

pytestmark = pytest.mark.integration
TANDEM = str(Path(sys.executable).parent / "tandem")
NODE_ARGS = "--num-kv-blocks 640 --max-num-seqs 16 --log-level INFO"
# round robin spreads requests over both decode nodes, always disaggregated (the KV moves from P to D)
PROXY_ARGS = "--routing round_robin"
LONG_TOKENS = 2000  # a request that is sure to be running when its node is told to leave
# `tandem serve` gives its local Ray every CPU; a power of two per node makes the room exact arithmetic, and at
# most 64 nodes whatever the machine (the admin API's own bound is 256)
CPUS = os.cpu_count() or 1
NODE_CPUS = 2.0 ** max(-1, math.ceil(math.log2(CPUS / 64)))
ROOM = int(CPUS // NODE_CPUS)


@dataclass
class LocalCluster:
    popen: subprocess.Popen[bytes]
    url: str
    model: Path
    cache_dir: Path
    log_path: Path
    env: dict[str, str]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`tandem ARGS` as a user runs it next to the cluster: it finds the admin API by itself."""
        return subprocess.run([TANDEM, *args], env=self.env, capture_output=True, text=True, timeout=30)

    def status(self) -> dict[str, Any]:
        done = self.cli("status", "--json")
        assert done.returncode == 0, done.stderr
        return dict(json.loads(done.stdout))

    def wait_for_pools(self, prefill: int, decode: int, timeout: float = 90.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            status = self.status()
            pools = status["pools"]
            if all(pools[role]["ready"] == pools[role]["desired"] == size and pools[role]["starting"] == 0
                   and pools[role]["draining"] == 0 for role, size in (("prefill", prefill), ("decode", decode))):
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(f"pools not at {prefill}/{decode}: {status}\n{self.log()[-3000:]}")
            time.sleep(0.3)


@pytest.fixture(scope="module")
def cluster(tiny_model: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(tiny_model("llama", max_position_embeddings=2048), tmp_path_factory.mktemp("tandem")) as c:
        yield c


@contextmanager
def local_cluster(model: Path, cache_dir: Path, *flags: str) -> Iterator[LocalCluster]:
    """`tandem serve` with one prefill and one decode node (unless `flags` say otherwise), stopped on exit."""
    assert Path(TANDEM).exists(), "the `tandem` command is missing: pip install -e ."
    port = free_port()
    # PYTHONPATH: the `tandem` script, Ray's workers and the nodes run this checkout's code, as `python -m` does
    env = {**os.environ, "TANDEM_CACHE_DIR": str(cache_dir), "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1",
           "TANDEM_NODE_ARGS": NODE_ARGS, "TANDEM_PROXY_ARGS": PROXY_ARGS,
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("TANDEM_ADMIN_URL", None)
    log_path = cache_dir / "serve.log"
    command = [TANDEM, "serve", "--model", str(model), "--port", str(port), "--served-model-name", "tiny",
               "--dtype", "float32", "--drain-timeout", "30", "--node-cpus", str(NODE_CPUS), *flags]
    with log_path.open("wb") as log:
        popen = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    cluster = LocalCluster(popen, f"http://127.0.0.1:{port}", model, cache_dir, log_path, env)
    try:
        deadline = time.monotonic() + 120
        while "Tandem is serving" not in cluster.log():
            if popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tandem serve did not start (code {popen.poll()}):\n{cluster.log()[-5000:]}")
            time.sleep(0.2)
        yield cluster
    finally:
        _stop(popen)


def _stop(popen: subprocess.Popen[bytes]) -> None:
    """SIGTERM to `tandem serve` alone: it stops the proxy, the nodes, Ray and redis-server itself."""
    if popen.poll() is None:
        popen.send_signal(signal.SIGTERM)
        try:
            popen.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()


@dataclass
class Load:
    """Streaming completions on a few threads (in a loop, or `once` each), recording every failure."""

    url: str
    num_threads: int = 3
    max_tokens: int = 32
    once: bool = False
    stop: threading.Event = field(default_factory=threading.Event)
    num_ok: int = 0
    failures: list[str] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Load:
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.num_threads)]
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        if not self.once:
            self.stop.set()
        for thread in self.threads:
            thread.join(60)

    def _run(self, index: int) -> None:
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                self._one(client, f"request {index} {self.num_ok}: the")
                if self.once:
                    return

    def _one(self, client: httpx.Client, prompt: str) -> None:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        try:
            with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    self.failures.append(f"HTTP {r.status_code}: {r.read()!r}")
                    return
                finish, usage = None, None
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            self.failures.append(f"error chunk: {chunk}")
                            return
                        finish = (chunk["choices"] or [{}])[0].get("finish_reason") or finish
                        usage = chunk.get("usage") or usage
            if finish != "length" or usage is None or usage["completion_tokens"] != self.max_tokens:
                self.failures.append(f"incomplete stream: finish {finish}, usage {usage}")
            else:
                self.num_ok += 1
        except httpx.HTTPError as e:
            self.failures.append(f"{type(e).__name__}: {e}")

    def wait_for(self, num_ok: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.num_ok < num_ok and not self.failures:
            assert time.monotonic() < deadline, f"only {self.num_ok} requests finished"
            time.sleep(0.1)


def num_running(address: str) -> int:
    async def stats() -> int:
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await tandem_pb2_grpc.DecodeServiceStub(channel).Stats(pb.StatsRequest(), timeout=5)
            return int(reply.num_running)

    return asyncio.run(stats())


def test_serve_answers_completions_and_chat_through_the_openai_sdk(cluster: LocalCluster) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{cluster.url}/v1", api_key="unused")
    completion = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0)
    assert completion.usage is not None and completion.usage.completion_tokens == 5
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi!"}],
                                            max_tokens=6, stream=True)
    chunks = list(stream)
    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_status_finds_the_cluster_through_its_private_state_file(cluster: LocalCluster) -> None:
    state_file = cluster.cache_dir / "cluster.json"
    assert stat.S_IMODE(state_file.stat().st_mode) == 0o600
    state = json.loads(state_file.read_text())
    assert state["proxy_url"] == cluster.url and state["pid"] == cluster.popen.pid
    status = cluster.wait_for_pools(1, 1)
    assert {k: status["pools"]["decode"][k] for k in ("desired", "ready")} == {"desired": 1, "ready": 1}
    assert httpx.get(state["admin_url"] + "/status").status_code == 401  # the token is required
    human = cluster.cli("status")
    assert human.returncode == 0 and "decode" in human.stdout
    too_many = cluster.cli("scale", "--decode", str(ROOM))  # with the prefill node, one more than there is room for
    assert too_many.returncode == 2, too_many.stderr
    assert f"{ROOM + 1} nodes do not fit on this machine: it has room for {ROOM}" in too_many.stderr
    assert cluster.status()["pools"]["decode"]["desired"] == 1


def test_decode_pool_scales_up_and_down_while_requests_stream_and_none_fails(cluster: LocalCluster) -> None:
    with Load(cluster.url) as load:
        load.wait_for(3)
        scaled = cluster.cli("scale", "--decode", "2")
        assert scaled.returncode == 0, scaled.stderr
        status = cluster.wait_for_pools(1, 2)
        load.wait_for(load.num_ok + 10)  # both decode nodes take requests
    new_node = max((n for n in status["nodes"] if n["role"] == "decode"), key=lambda n: int(n["node_id"][7:]))
    # Alone, round robin sends two of the four long requests to each decode node: the node told to leave
    # surely has requests in hand, that last long after it is told.
    with Load(cluster.url, num_threads=4, max_tokens=LONG_TOKENS, once=True) as long:
        deadline = time.monotonic() + 20
        while num_running(new_node["address"]) < 2:
            assert time.monotonic() < deadline and not long.failures, long.failures
            time.sleep(0.05)
        with Load(cluster.url) as load:
            assert cluster.cli("scale", "--decode", "1").returncode == 0
            cluster.wait_for_pools(1, 1, timeout=60)
            load.wait_for(load.num_ok + 3)  # still serving after the scale-down
    assert load.failures == [] and long.failures == [] and long.num_ok == 4
    remaining = {n["node_id"] for n in cluster.status()["nodes"]}
    assert new_node["node_id"] not in remaining  # the newest node was the one removed
    node_log = next((cluster.cache_dir / "logs").glob(f"serve-*/{new_node['node_id']}.log")).read_text()
    drain_line = re.search(r"draining: (\d+) RPCs in flight", node_log)
    assert drain_line is not None and int(drain_line.group(1)) >= 2, node_log[-3000:]
    assert "stopped" in node_log


def test_a_node_that_dies_is_replaced(cluster: LocalCluster) -> None:
    # the node to kill is one this test adds (and the pool goes back to one decode node at the end)
    cluster.wait_for_pools(1, 1)
    before = {n["node_id"] for n in cluster.status()["nodes"]}
    assert cluster.cli("scale", "--decode", "2").returncode == 0
    try:
        added = next(n for n in cluster.wait_for_pools(1, 2)["nodes"] if n["node_id"] not in before)
        os.kill(_pid_of(added["node_id"], cluster.model), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while added["node_id"] in {n["node_id"] for n in cluster.status()["nodes"]}:
            assert time.monotonic() < deadline, "the dead node is still listed"
            time.sleep(0.3)
        replacement = next(n for n in cluster.wait_for_pools(1, 2)["nodes"]
                           if n["node_id"] not in before | {added["node_id"]})
        deadline = time.monotonic() + 10
        while httpx.get(f"{cluster.url}/health").status_code != 200:  # the proxy polls the registry
            assert time.monotonic() < deadline, "the proxy does not see the new node"
            time.sleep(0.1)
        with Load(cluster.url, num_threads=2, once=True) as load:  # round robin: one request on each decode node
            pass
        assert load.failures == [] and load.num_ok == 2
        assert num_running(replacement["address"]) == 0  # it serves (and finished its request)
    finally:
        cluster.cli("scale", "--decode", "1")
        cluster.wait_for_pools(1, 1, timeout=60)


def _pid_of(node_id: str, model: Path) -> int:
    """The process of this cluster's node `node_id` (the test knows nodes by id, not by pid)."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (b"--node-id" in argv and argv[argv.index(b"--node-id") + 1] == node_id.encode()
                and str(model.resolve()).encode() in argv):
            return int(proc.name)
    raise LookupError(node_id)


def test_stopping_serve_removes_the_state_file_and_every_process(tiny_model: TinyModelFactory,
                                                                 tmp_path: Path) -> None:
    # a cluster of its own (one node is enough): stopping the module's would fail every test that runs after this
    with local_cluster(tiny_model("llama", max_position_embeddings=2048), tmp_path, "--decode-nodes", "0") as own:
        addresses = [n["address"] for n in own.wait_for_pools(1, 0)["nodes"]]
        assert len(addresses) == 1
        _stop(own.popen)
        assert own.popen.returncode == 0, own.log()[-3000:]
    assert not (own.cache_dir / "cluster.json").exists()
    for address in [*addresses, own.url.removeprefix("http://")]:
        host, port = address.rsplit(":", 1)
        with pytest.raises(OSError):
            socket.create_connection((host, int(port)), timeout=1).close()
