"""KV crossing hosts with the real product: a prefill node on host A, a decode node on host B and the proxy on host C
(network namespaces with PID namespaces of their own, tests/multihost/hosts.py). A greedy completion equals
transformers', and the prompt's KV blocks really crossed A's link (its byte counter, against the blocks' size).

Transport settings for a host: NIXL's UCX is given the host's interface (`--ucx-devices eth0`), not `lo`; Mooncake
advertises `--host`, the host's address. Nothing else is needed: with a PID namespace per host, UCX sees another
machine and reads over tcp/eth0 (in one PID namespace it would read with CMA, whatever the devices say)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy
from tests.multihost.hosts import Host, Hosts, host_environment

pytestmark = [pytest.mark.multihost, pytest.mark.integration]
ROOT = Path(__file__).resolve().parents[2]
# each host is a network namespace of its own: nothing else can hold these ports
PREFILL_PORT, DECODE_PORT, PROXY_PORT = 7000, 7001, 8000
BLOCK_SIZE = 4


def _wait_for_line(log_path: Path, text: str, process: subprocess.Popen[bytes], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log_path.exists() and text in log_path.read_text():
            return
        if process.poll() is not None:
            raise RuntimeError(f"{log_path.name}: exited\n{log_path.read_text()[-4000:]}")
        time.sleep(0.1)
    raise TimeoutError(f"{log_path.name}: no {text!r} in {timeout} s\n{log_path.read_text()[-4000:]}")


def _start_node(host: Host, role: str, port: int, model: Path, backend: str, log_dir: Path
                ) -> tuple[subprocess.Popen[bytes], Path]:
    """`backend` "<name>-bind-all": the node listens on every interface and advertises the host's address, as in a
    Kubernetes pod (the address peers dial must be the advertised one, never 0.0.0.0)."""
    log_path = log_dir / f"{role}.log"
    backend, bind_all, _ = backend.partition("-bind-all")
    where = ["--host", "0.0.0.0", "--advertise-address", f"{host.ip}:{port}"] if bind_all else ["--host", host.ip]
    process = host.run([sys.executable, "-m", f"{role}_node", "--model", str(model), "--dtype", "float32",
                        *where, "--port", str(port), "--kv-backend", backend, "--ucx-devices", host.device,
                        "--block-size", str(BLOCK_SIZE), "--num-kv-blocks", "64", "--max-num-seqs", "8",
                        "--log-level", "INFO"], env=host_environment(), log_path=log_path, cwd=ROOT)
    return process, log_path


def _complete(url: str, prompt: list[int], max_tokens: int) -> dict[str, object]:
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


class Cluster:
    def __init__(self, hosts: Hosts, backend: str, log_dir: Path) -> None:
        self.hosts, self.backend, self.log_dir = hosts, backend, log_dir


@pytest.fixture(params=["nixl", "mooncake", "auto", "mooncake-bind-all"])
def cluster(request: pytest.FixtureRequest, tiny_model: TinyModelFactory, tmp_path: Path) -> Iterator[Cluster]:
    """Prefill on hosts[0], decode on hosts[1], the proxy on hosts[2] handing every request from P to D."""
    model = tiny_model("llama")
    with Hosts(3) as hosts:
        prefill_host, decode_host, proxy_host = hosts
        started = [_start_node(prefill_host, "prefill", PREFILL_PORT, model, request.param, tmp_path),
                   _start_node(decode_host, "decode", DECODE_PORT, model, request.param, tmp_path)]
        for process, log_path in started:
            _wait_for_line(log_path, "READY", process)
        proxy_host.run([sys.executable, "-m", "proxy", "--model", str(model), "--host", proxy_host.ip,
                        "--port", str(PROXY_PORT), "--prefill", f"{prefill_host.ip}:{PREFILL_PORT}",
                        "--decode", f"{decode_host.ip}:{DECODE_PORT}", "--colocate-max-tokens", "0",
                        "--request-timeout", "60", "--log-level", "warning"],
                       env=host_environment(), log_path=tmp_path / "proxy.log", cwd=ROOT)
        proxy_host.wait_healthy(f"http://{proxy_host.ip}:{PROXY_PORT}", timeout=60)
        yield Cluster(hosts, request.param, tmp_path)


def test_a_completion_handed_across_hosts_equals_transformers_and_its_kv_crossed_the_link(
        cluster: Cluster, tiny_model: TinyModelFactory) -> None:
    from transformers import AutoTokenizer

    model = tiny_model("llama")
    config = json.loads((model / "config.json").read_text())
    prefill_host, _, proxy_host = cluster.hosts
    prompt = random.Random(7).choices(range(3, 1000), k=30 * BLOCK_SIZE)  # 30 full blocks
    sent_before = prefill_host.link_bytes()[1]
    body = proxy_host.call(_complete, f"http://{proxy_host.ip}:{PROXY_PORT}", prompt, 8)
    sent = prefill_host.link_bytes()[1] - sent_before

    expected = hf_greedy(model, [prompt], 8)[0]
    assert body["choices"][0]["text"] == AutoTokenizer.from_pretrained(str(model)).decode(  # type: ignore[index]
        expected, skip_special_tokens=True)
    # float32 K and V of every layer and KV head, per block: what the decode node had to pull from host A
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    kv_bytes = 30 * config["num_hidden_layers"] * config["num_key_value_heads"] * 2 * BLOCK_SIZE * head_dim * 4
    assert sent >= kv_bytes, f"{cluster.backend}: host A sent {sent} B, the prompt's KV is {kv_bytes} B"
    if cluster.backend == "auto":  # another PID and network namespace: ipc refuses the peer, the default takes it
        assert "reading over nixl" in (cluster.log_dir / "decode.log").read_text()
