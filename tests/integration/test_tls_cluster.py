"""A cluster with mutual TLS everywhere (issue 13, item 5): real prefill and decode node processes started with
--tls-cert/--tls-key/--tls-client-ca, the decode node calling the prefill node with --node-tls-*, and a proxy with
--node-tls-*. A disaggregated request streams transformers' greedy tokens, the decode node releases its ticket on
the prefill node over mutual TLS, and a caller without a client certificate is refused by both nodes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from node_common.tls import PLAINTEXT, ChannelSecurity
from proxy.routing.clients import DecodeClient, NodeClient, PrefillClient
from settings.tls import ClientTLSSettings
from tests.fixtures.certificates import Certificates, make_certificates
from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy
from tests.integration.processes import Process, launch_node, start_proxy

pytestmark = pytest.mark.integration

PROMPT = list(range(100, 124))
MAX_TOKENS = 6


@dataclass
class TLSCluster:
    model: Path
    certs: Certificates
    prefill: str
    decode: str
    url: str
    logs: list[Process]


def client_flags(certs: Certificates) -> list[str]:
    return ["--node-tls-ca", str(certs.ca), "--node-tls-cert", str(certs.client.cert), "--node-tls-key",
            str(certs.client.key)]


@pytest.fixture(scope="module")
def cluster(tiny_model: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSCluster]:
    model = tiny_model("llama")
    certs = make_certificates(tmp_path_factory.mktemp("certificates"))
    log_dir = tmp_path_factory.mktemp("tls-cluster-logs")
    server = ["--tls-cert", str(certs.server.cert), "--tls-key", str(certs.server.key), "--tls-client-ca",
              str(certs.ca)]
    processes: list[Process] = []
    try:
        prefill, prefill_address = launch_node("prefill", model, "ipc", log_dir, server)
        processes.append(prefill)
        decode, decode_address = launch_node("decode", model, "ipc", log_dir, [*server, *client_flags(certs)])
        processes.append(decode)
        for process in processes:
            process.wait_for_line("READY")
        proxy, url = start_proxy(model, prefill_address, decode_address, log_dir,
                                 ["--colocate-max-tokens", "0", "--block-size", "4", *client_flags(certs)])
        processes.append(proxy)
        yield TLSCluster(model, certs, prefill_address, decode_address, url, processes)
    finally:
        for process in reversed(processes):
            process.stop()


def test_a_disaggregated_request_streams_the_greedy_tokens_over_mutual_tls(cluster: TLSCluster) -> None:
    from transformers import AutoTokenizer

    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    (expected,) = hf_greedy(cluster.model, [PROMPT], MAX_TOKENS)
    assert text == AutoTokenizer.from_pretrained(str(cluster.model)).decode(expected, skip_special_tokens=True)
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    assert 'tandem:pd_decisions_total{mode="disaggregated",model_name=' in metrics  # P then D, not D alone

    async def pinned_tickets() -> int:
        client = PrefillClient(cluster.prefill, ChannelSecurity.from_settings(ClientTLSSettings(
            str(cluster.certs.ca), str(cluster.certs.client.cert), str(cluster.certs.client.key))))
        try:
            return (await client.stats()).num_pinned_tickets
        finally:
            await client.close()

    # the decode node released the ticket (a lease RPC over mutual TLS), long before the lease would expire
    assert asyncio.run(pinned_tickets()) == 0
    assert "releasing ticket" not in cluster.logs[1].log()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_node_refuses_callers_without_a_client_certificate(cluster: TLSCluster, role: str) -> None:
    address = cluster.prefill if role == "prefill" else cluster.decode
    kind = PrefillClient if role == "prefill" else DecodeClient

    async def health(security: ChannelSecurity) -> grpc.StatusCode | None:
        client: NodeClient = kind(address, security)
        try:
            await client.health(timeout=5)
        except grpc.aio.AioRpcError as e:
            return e.code()
        finally:
            await client.close()
        return None

    assert asyncio.run(health(PLAINTEXT)) == grpc.StatusCode.UNAVAILABLE
    no_cert = ChannelSecurity.from_settings(ClientTLSSettings(str(cluster.certs.ca)))
    assert asyncio.run(health(no_cert)) == grpc.StatusCode.UNAVAILABLE
