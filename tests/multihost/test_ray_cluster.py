"""`tandem serve` on a real Ray cluster of three machines (network + PID namespaces, tests/multihost/hosts.py):
a Ray head on host 0 and workers on hosts 1 and 2, each started with `ray start` as on real machines; redis-server
and `tandem serve --ray-address ... --placement spread` on host 0. The prefill and decode nodes land on different
machines, each serving on its machine's address; a greedy completion through the proxy equals transformers'; and
`tandem scale --decode 2` puts the new decode node on the machine with no node yet.

Every machine's Ray node starts with the environment a node process needs there (as a real machine's would): no
InfiniBand UCX modules, and none of the loopback-only settings a test run may carry. Ray keeps its files in a
temporary directory per machine (one file system serves all three: their Unix sockets must not meet)."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy
from tests.multihost.hosts import Host, Hosts, host_environment

pytestmark = [pytest.mark.multihost, pytest.mark.integration]
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RAY_PORT, REDIS_PORT, PROXY_PORT = 6379, 6380, 8000  # each host is a network namespace: nothing else holds them
NODE_ARGS = "--num-kv-blocks 64 --max-num-seqs 8"


def _environment(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in host_environment().items()
           if not key.startswith("RAY_") and key != "TANDEM_ADMIN_URL"}
    return {**env, "RAY_AUTH_MODE": "disabled",
            "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]), **extra}


def _wait_until(what: str, ready: Any, timeout: float, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.exists())
            raise TimeoutError(f"{what} after {timeout:.0f} s\n{tails}")
        time.sleep(0.3)


def _listening(address: tuple[str, int]) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex(address) == 0


@dataclass
class RayCluster:
    hosts: Hosts
    log_dir: Path
    serve: subprocess.Popen[bytes]
    env: dict[str, str]
    _num_calls: int = 0

    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def proxy_url(self) -> str:
        return f"http://{self.head.ip}:{PROXY_PORT}"

    def tandem(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`tandem ARGS` on host 0, next to `tandem serve`: it finds the admin API through the state file, which
        names `tandem serve` by its pid on that host. stdout only (stderr goes to the test's log)."""
        self._num_calls += 1
        out = self.log_dir / f"tandem-{self._num_calls}.out"
        with out.open("wb") as stdout:
            # nsenter (the Popen) forks `tandem serve` into the host's PID namespace: its one child, after the execs
            # of ip netns exec, unshare and sh
            serve_pid = Path(f"/proc/{self.serve.pid}/task/{self.serve.pid}/children").read_text().split()[0]
            process = subprocess.Popen(["nsenter", "--target", serve_pid, "--pid", "--mount", "--net", "--",
                                        str(BIN / "tandem"), *args],
                                       env=self.env, stdout=stdout, stderr=subprocess.PIPE)
            _, stderr = process.communicate(timeout=30)
        return subprocess.CompletedProcess(process.args, process.returncode, out.read_text(), stderr.decode())

    def status(self) -> dict[str, Any]:
        done = self.tandem("status", "--json")
        assert done.returncode == 0, done.stderr
        return dict(json.loads(done.stdout))

    def wait_for_nodes(self, prefill: int, decode: int, timeout: float) -> list[dict[str, Any]]:
        """The nodes once each pool has that many ready and nothing else."""
        def settled() -> bool:
            nodes = self.status()["nodes"]
            return sorted(n["role"] for n in nodes if n["state"] == "ready") == ["decode"] * decode + [
                "prefill"] * prefill and len(nodes) == prefill + decode
        _wait_until(f"pools not at {prefill}/{decode}", settled, timeout, [self.log_dir / "serve.log"])
        return list(self.status()["nodes"])


def _with_own_proc(argv: list[str]) -> list[str]:
    """`argv` with a /proc of the host's PID namespace (in a mount namespace of its own). The harness's hosts share
    the box's /proc, where a host's pid names another process or none: UCX reads /proc/<its pid>/stat for its start
    time and, finding none, fails to create even its endpoint to itself ("failed to get start time for pid N"). A
    real machine has its own /proc; so does each Ray node and `tandem serve` here (Ray's driver looks itself up
    there too)."""
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
            'mount -t proc proc /proc && exec "$@"', "sh", *argv]


def _ray_start(host: Host, head: Host, index: int, temp_dir: Path, env: dict[str, str], log_dir: Path) -> None:
    where = ["--head", "--port", str(RAY_PORT), "--include-dashboard=false"] if host is head else [
        "--address", f"{head.ip}:{RAY_PORT}"]
    host.run(_with_own_proc([str(BIN / "ray"), "start", "--block", *where, "--node-ip-address", host.ip,
                             "--num-cpus", "1", "--resources", json.dumps({f"host{index}": 1}),
                             "--disable-usage-stats", "--temp-dir", str(temp_dir / f"h{index}")]),
             env=env, log_path=log_dir / f"ray-h{index}.log", cwd=ROOT)


@pytest.fixture
def ray_cluster(tiny_model: TinyModelFactory, tmp_path: Path) -> Iterator[RayCluster]:
    model = tiny_model("llama")
    # short: Ray's Unix sockets live under it, and a socket path has at most 107 characters
    temp_dir = Path(tempfile.mkdtemp(prefix="tnd-ray-", dir="/tmp"))
    env = _environment(TANDEM_CACHE_DIR=str(tmp_path / "cache"))
    started = time.monotonic()
    try:
        with Hosts(3) as hosts:
            head = hosts[0]
            # redis answers clients of other machines only out of protected mode (or with a password)
            head.run(["redis-server", "--bind", head.ip, "--port", str(REDIS_PORT), "--protected-mode", "no",
                      "--save", "", "--appendonly", "no"], env=env, log_path=tmp_path / "redis.log")
            for index, host in enumerate(hosts):
                _ray_start(host, head, index, temp_dir, env, tmp_path)
                if host is head:  # the workers join a head that listens
                    head.call(_wait_until, "no Ray head", lambda: _listening((head.ip, RAY_PORT)), 60,
                              [tmp_path / "ray-h0.log"], timeout=70)
            # all three machines in the cluster before tandem serve spreads nodes over them
            workers = [tmp_path / f"ray-h{index}.log" for index in (1, 2)]
            _wait_until("the Ray workers did not join", lambda: all(
                "Ray runtime started" in log.read_text(errors="replace") for log in workers), 60, workers)
            print(f"Ray cluster of 3 machines up in {time.monotonic() - started:.1f} s")
            serve = head.run(_with_own_proc([str(BIN / "tandem"), "serve", "--ray-address", f"{head.ip}:{RAY_PORT}",
                              "--registry", f"redis://{head.ip}:{REDIS_PORT}/0", "--model", str(model),
                              "--served-model-name", "tiny", "--host", head.ip, "--port", str(PROXY_PORT),
                              "--placement", "spread", "--prefill-nodes", "1", "--decode-nodes", "1",
                              "--dtype", "float32", "--ucx-devices", head.device, "--node-args", NODE_ARGS,
                              "--proxy-args", "--colocate-max-tokens 0", "--startup-timeout", "60"]),
                             env=env, log_path=tmp_path / "serve.log", cwd=ROOT)
            logs = [tmp_path / name for name in ("serve.log", "ray-h0.log", "ray-h1.log", "ray-h2.log")]
            _wait_until("tandem serve is not serving", lambda: serve.poll() is not None
                        or "Tandem is serving" in (tmp_path / "serve.log").read_text(errors="replace"), 150, logs)
            assert serve.poll() is None, (tmp_path / "serve.log").read_text(errors="replace")[-5000:]
            print(f"tandem serve serving at {time.monotonic() - started:.1f} s")
            yield RayCluster(hosts, tmp_path, serve, env)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def _hosts_of(nodes: list[dict[str, Any]]) -> dict[str, list[str]]:
    hosts: dict[str, list[str]] = {}
    for node in nodes:
        hosts.setdefault(node["role"], []).append(node["address"].rpartition(":")[0])
    return hosts


def _complete(url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_spread_puts_prefill_and_decode_on_different_machines_and_scale_adds_one_on_the_idle_machine(
        ray_cluster: RayCluster, tiny_model: TinyModelFactory) -> None:
    from transformers import AutoTokenizer

    machines = {host.ip for host in ray_cluster.hosts}
    placed = _hosts_of(ray_cluster.wait_for_nodes(prefill=1, decode=1, timeout=30))
    # each node serves on its own machine's address, and the two are on different machines
    assert set(placed["prefill"] + placed["decode"]) <= machines, placed
    assert placed["prefill"] != placed["decode"], placed

    model = tiny_model("llama")
    prompt = random.Random(3).choices(range(3, 1000), k=40)
    body = ray_cluster.head.call(_complete, ray_cluster.proxy_url, prompt, 8)
    expected = hf_greedy(model, [prompt], 8)[0]
    assert body["choices"][0]["text"] == AutoTokenizer.from_pretrained(str(model)).decode(
        expected, skip_special_tokens=True)

    scaled = ray_cluster.tandem("scale", "--decode", "2")
    assert scaled.returncode == 0, scaled.stderr
    now = _hosts_of(ray_cluster.wait_for_nodes(prefill=1, decode=2, timeout=90))
    # the least-loaded machine: the one with no node yet
    assert set(now["decode"]) == set(placed["decode"]) | (machines - set(placed["prefill"] + placed["decode"])), now
