"""One prefill node, one decode node and the proxy as separate processes on loopback, for every KV transfer
backend: completions equal transformers' greedy tokens, no block leaks, leases, aborts, restarts, and
corruption caught by the checksum."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from protos import tandem_pb2 as pb
from protos import tandem_pb2_grpc
from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy
from tests.integration.processes import launch_node, start_node, start_proxy

pytestmark = pytest.mark.integration
BACKENDS = ["nixl", "mooncake", "ipc", "auto"]


class Cluster:
    def __init__(self, model: Path, backend: str, log_dir: Path, lease_seconds: float = 30.0) -> None:
        self.model, self.backend, self.log_dir = model, backend, log_dir
        self.lease_seconds = lease_seconds
        self.prefill, self.prefill_address = launch_node("prefill", model, backend, log_dir,
                                                         ["--lease-seconds", str(lease_seconds)])
        self.decode, self.decode_address = launch_node("decode", model, backend, log_dir)
        try:
            for node in (self.prefill, self.decode):
                node.wait_for_line("READY")
            # these tests are about the P/D handoff: the router must never run a (short) prompt on D alone
            self.proxy, self.url = start_proxy(model, self.prefill_address, self.decode_address, log_dir,
                                               ["--colocate-max-tokens", "0"])
        except BaseException:
            for node in (self.decode, self.prefill):
                node.stop()
            raise

    def restart_prefill(self) -> None:
        port = int(self.prefill_address.rsplit(":", 1)[1])
        self.prefill.stop()
        self.prefill, _ = start_node("prefill", self.model, self.backend, self.log_dir,
                                     ["--lease-seconds", str(self.lease_seconds)], port=port)

    def stop(self) -> None:
        for process in (self.proxy, self.decode, self.prefill):
            process.stop()

    def stats(self, role: str) -> pb.StatsResponse:
        return asyncio.run(_stats(self.prefill_address if role == "prefill" else self.decode_address, role))

    def complete(self, **body: object) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/completions", json=body, timeout=60)


async def _stats(address: str, role: str) -> pb.StatsResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = (tandem_pb2_grpc.PrefillServiceStub if role == "prefill" else tandem_pb2_grpc.DecodeServiceStub)(channel)
        return await stub.Stats(pb.StatsRequest(), timeout=5)


def _greedy(max_tokens: int = 8) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0, max_tokens=max_tokens,
                             ignore_eos=True)


async def _prefill(address: str, prompt: list[int], params: pb.SamplingParams | None = None) -> pb.PrefillResponse:
    params = params or _greedy()
    async with grpc.aio.insecure_channel(address) as channel:
        return await tandem_pb2_grpc.PrefillServiceStub(channel).Prefill(
            pb.PrefillRequest(request_id=f"direct-{time.monotonic_ns()}", prompt_token_ids=prompt, params=params),
            timeout=30)


async def _generate(address: str, prompt: list[int], prefilled: pb.PrefillResponse | None,
                    params: pb.SamplingParams | None = None) -> list[int]:
    """D's tokens for a prefilled prompt, or for a colocated one (prefilled None: D computes it all)."""
    request = pb.GenerateRequest(request_id=f"gen-{time.monotonic_ns()}", prompt_token_ids=prompt,
                                 params=params or _greedy())
    if prefilled is not None:
        request.ticket.CopyFrom(prefilled.ticket)
        request.first_token = prefilled.first_token
    async with grpc.aio.insecure_channel(address) as channel:
        call = tandem_pb2_grpc.DecodeServiceStub(channel).Generate(request, timeout=30)
        return [t async for r in call for t in r.token_ids]


def wait_until(condition, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.1)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(length)] for _ in range(n)]


@pytest.fixture(scope="module", params=BACKENDS)
def cluster(request: pytest.FixtureRequest, tiny_model: TinyModelFactory,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tiny_model("llama"), request.param, tmp_path_factory.mktemp(f"logs-{request.param}"),
                lease_seconds=5.0)  # short, for the expiry test; long enough for a loaded box between P and D
    yield c
    c.stop()


def test_greedy_completions_through_the_proxy_equal_transformers(cluster: Cluster, tiny_model: TinyModelFactory
                                                                  ) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(cluster.model))
    batch = prompts(3, 13, seed=1) + prompts(1, 2, seed=2)
    expected = hf_greedy(tiny_model("llama"), batch, 10)
    for prompt, tokens in zip(batch, expected, strict=True):
        r = cluster.complete(prompt=prompt, max_tokens=10, temperature=0, ignore_eos=True)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == tokenizer.decode(tokens, skip_special_tokens=True)
        assert body["usage"]["completion_tokens"] == 10 and body["choices"][0]["finish_reason"] == "length"


def test_streaming_sends_the_same_text_first_token_first(cluster: Cluster) -> None:
    prompt = prompts(1, 9, seed=3)[0]
    whole = cluster.complete(prompt=prompt, max_tokens=12, temperature=0, ignore_eos=True).json()
    pieces, finishes = [], []
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json={
            "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True},
            timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                pieces.append(choice["text"])
                finishes.append(choice["finish_reason"])
    assert len(pieces) >= 2 and "".join(pieces) == whole["choices"][0]["text"]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])


def test_no_blocks_leak_after_a_run(cluster: Cluster) -> None:
    for prompt in prompts(3, 11, seed=4):
        assert cluster.complete(prompt=prompt, max_tokens=5, temperature=0, ignore_eos=True).status_code == 200
    wait_until(lambda: cluster.stats("prefill").num_pinned_tickets == 0)
    p, d = cluster.stats("prefill"), cluster.stats("decode")
    assert p.free_kv_blocks == p.total_kv_blocks and d.free_kv_blocks == d.total_kv_blocks


def test_a_ticket_never_pulled_is_freed_when_its_lease_expires(cluster: Cluster) -> None:
    prefilled = asyncio.run(_prefill(cluster.prefill_address, prompts(1, 10, seed=5)[0]))
    assert prefilled.HasField("ticket") and len(prefilled.ticket.block_ids) == 3
    stats = cluster.stats("prefill")
    assert stats.num_pinned_tickets == 1 and stats.free_kv_blocks == stats.total_kv_blocks - 3
    expired = stats.num_leases_expired
    wait_until(lambda: cluster.stats("prefill").num_pinned_tickets == 0, timeout=cluster.lease_seconds + 5)
    stats = cluster.stats("prefill")
    assert stats.free_kv_blocks == stats.total_kv_blocks and stats.num_leases_expired == expired + 1


def test_a_client_disconnect_frees_blocks_on_both_sides(cluster: Cluster) -> None:
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json={
            "prompt": prompts(1, 9, seed=6)[0], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    # the stream is closed early: the proxy aborts on D and releases on P

    def freed() -> bool:
        p, d = cluster.stats("prefill"), cluster.stats("decode")
        return (p.free_kv_blocks == p.total_kv_blocks and d.free_kv_blocks == d.total_kv_blocks
                and d.num_running == 0 and p.num_pinned_tickets == 0)

    wait_until(freed)


def test_bad_tickets_get_clear_errors_and_the_node_survives(cluster: Cluster) -> None:
    prompt = prompts(1, 10, seed=7)[0]
    prefilled = asyncio.run(_prefill(cluster.prefill_address, prompt))
    unknown = pb.PrefillResponse()
    unknown.CopyFrom(prefilled)
    unknown.ticket.ticket_id = "no-such-ticket"
    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(_generate(cluster.decode_address, prompt, unknown))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    garbled = pb.PrefillResponse()
    garbled.CopyFrom(prefilled)
    garbled.ticket.transfer_metadata = b"garbage"
    garbled.ticket.layout_hash = "0" * 32
    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(_generate(cluster.decode_address, prompt, garbled))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "layout" in (e.value.details() or "")
    malformed = pb.PrefillResponse()
    malformed.CopyFrom(prefilled)
    del malformed.ticket.block_checksums[-1]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(_generate(cluster.decode_address, prompt, malformed))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "checksums" in (e.value.details() or "")
    unverifiable = pb.PrefillResponse()  # a checksum algorithm D does not know: refused before the pull
    unverifiable.CopyFrom(prefilled)
    unverifiable.ticket.block_checksums[0] = "md5:00"
    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(_generate(cluster.decode_address, prompt, unverifiable))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "algorithm" in (e.value.details() or "")
    # the real ticket still works afterwards
    assert len(asyncio.run(_generate(cluster.decode_address, prompt, prefilled))) == 7
    assert cluster.decode.alive and cluster.prefill.alive


def test_a_ticket_names_the_prefill_nodes_advertised_address_not_its_bind_host(tiny_model: TinyModelFactory,
                                                                              tmp_path: Path) -> None:
    # bound to every interface and given no --advertise-address, a node advertises its host name (what the
    # registry holds too): a decode node that called the bind address would call 0.0.0.0
    node, address = start_node("prefill", tiny_model("llama"), "nixl", tmp_path, ["--host", "0.0.0.0"])
    try:
        prefilled = asyncio.run(_prefill(address, prompts(1, 10, seed=11)[0]))
    finally:
        node.stop()
    port = address.rsplit(":", 1)[1]
    assert prefilled.ticket.prefill_address == f"{socket.getfqdn()}:{port}"


def test_a_transfer_of_the_wrong_bytes_is_caught_by_the_checksum(cluster: Cluster) -> None:
    # A ticket whose blocks are listed out of order: D pulls real blocks of P, but not the ones each checksum
    # describes, exactly as a transfer that delivered the wrong bytes would. No test hook in the nodes.
    prompt = prompts(1, 10, seed=9)[0]
    prefilled = asyncio.run(_prefill(cluster.prefill_address, prompt))
    shuffled = pb.PrefillResponse()
    shuffled.CopyFrom(prefilled)
    shuffled.ticket.block_ids[:] = list(reversed(prefilled.ticket.block_ids))
    failures = cluster.stats("decode").num_transfer_failures
    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(_generate(cluster.decode_address, prompt, shuffled))
    assert e.value.code() == grpc.StatusCode.DATA_LOSS and "checksum" in (e.value.details() or "")
    d = cluster.stats("decode")
    assert d.num_transfer_failures == failures + 1 and d.free_kv_blocks == d.total_kv_blocks
    # the untouched ticket still pulls and verifies
    assert len(asyncio.run(_generate(cluster.decode_address, prompt, prefilled))) == 7


def test_a_seeded_request_samples_the_same_tokens_offline_colocated_and_disaggregated(
        cluster: Cluster) -> None:
    from engine import LLM, SamplingParams

    prompt = prompts(1, 10, seed=12)[0]
    offline = LLM(model=str(cluster.model), dtype="float32", block_size=4).generate(
        [prompt], SamplingParams(temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True))
    expected = offline[0].outputs[0].token_ids
    params = pb.SamplingParams(temperature=1.0, top_p=1.0, repetition_penalty=1.0, max_tokens=8, ignore_eos=True,
                               seed=1234)
    colocated = asyncio.run(_generate(cluster.decode_address, prompt, None, params))
    prefilled = asyncio.run(_prefill(cluster.prefill_address, prompt, params))
    disaggregated = [prefilled.first_token, *asyncio.run(_generate(cluster.decode_address, prompt, prefilled,
                                                                   params))]
    assert len(set(expected)) > 1, "sampling at temperature 1 should vary"
    assert colocated == expected
    assert disaggregated == expected


def test_decode_reuses_its_own_prefix_cache_instead_of_pulling(cluster: Cluster, tiny_model: TinyModelFactory
                                                                ) -> None:
    from transformers import AutoTokenizer

    shared = prompts(1, 16, seed=10)[0]
    first, second = shared + [5, 6, 7], shared + [8, 9]
    assert cluster.complete(prompt=first, max_tokens=3, temperature=0, ignore_eos=True).status_code == 200
    hits_before = cluster.stats("decode").prefix_cache_hits
    r = cluster.complete(prompt=second, max_tokens=6, temperature=0, ignore_eos=True)
    assert r.status_code == 200, r.text
    # D found the 16-token shared prefix (4 blocks of 4) in its own cache and pulled only the last block
    assert cluster.stats("decode").prefix_cache_hits - hits_before == 16
    tokenizer = AutoTokenizer.from_pretrained(str(cluster.model))
    expected = hf_greedy(tiny_model("llama"), [second], 6)[0]
    assert r.json()["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)


def test_prompt_logprobs_from_the_nodes_equal_the_offline_engines(cluster: Cluster) -> None:
    """P returns them with the first token, D with a colocated request's first token, and the pipeline hands them
    to the HTTP layer on the first chunk either way (the second run finds the prompt in D's prefix cache: the
    request must not take those hits)."""
    if cluster.backend != "nixl":
        pytest.skip("prompt logprobs do not depend on the transport")
    from engine import LLM, SamplingParams
    from engine.types import PromptLogprobs
    from proxy.routing.clients import DecodeClient, PrefillClient
    from proxy.routing.directory import NodeDirectory
    from proxy.routing.pd import PDPipeline
    from proxy.routing.router import Router, RouterConfig

    prompt = prompts(1, 14, seed=13)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    offline = LLM(model=str(cluster.model), dtype="float32", block_size=4).generate([prompt], params)[0]
    expected = offline.prompt_logprobs
    assert expected is not None and len(expected) == len(prompt)

    async def through_the_nodes() -> list[PromptLogprobs | None]:
        deadline = time.time() + 30
        prefill, decode = PrefillClient(cluster.prefill_address), DecodeClient(cluster.decode_address)
        prefilled = await prefill.prefill("prompt-logprobs-p", prompt, params, deadline)
        assert prefilled.ticket is not None
        await prefill.release(prefilled.ticket)
        colocated = [out async for out in decode.generate("prompt-logprobs-d", prompt, params, None, deadline)]
        assert all(out.prompt_logprobs is None for out in colocated[1:])
        results = [prefilled.prompt_logprobs, colocated[0].prompt_logprobs]
        for colocate_max_tokens in (0, 1000):  # disaggregated, then colocated
            directory = NodeDirectory([cluster.prefill_address], [cluster.decode_address], block_size=4)
            pipeline = PDPipeline(directory, Router(directory, RouterConfig(block_size=4,
                                                                            colocate_max_tokens=colocate_max_tokens)))
            try:
                chunks = [c async for c in pipeline.generate(f"prompt-logprobs-{colocate_max_tokens}", prompt,
                                                             params, deadline)]
            finally:
                await pipeline.close()
            assert [t for c in chunks for t in c.token_ids] == offline.outputs[0].token_ids
            assert all(c.prompt_logprobs is None for c in chunks[1:])
            results.append(chunks[0].prompt_logprobs)
        for client in (prefill, decode):
            await client.close()
        return results

    for result in asyncio.run(through_the_nodes()):
        assert result is not None and len(result) == len(expected) and result[0] is None
        for got, want in zip(result[1:], expected[1:], strict=True):
            assert got is not None and want is not None and set(got) == set(want)
            assert all(got[t].rank == want[t].rank and abs(got[t].logprob - want[t].logprob) < 1e-5 for t in got)
    for role in ("prefill", "decode"):
        stats = cluster.stats(role)
        assert stats.free_kv_blocks == stats.total_kv_blocks


# Last in the file: it restarts the module's prefill node, so every other test of a backend has run before it.
def test_a_restarted_prefill_node_rejects_an_old_ticket(cluster: Cluster) -> None:
    if cluster.backend == "auto":
        # auto between nodes of one host restarts as ipc does (a re-registered peer replacing its route is checked
        # in tests/kvtransfer/test_same_host.py)
        pytest.skip("auto restarts as ipc does")
    prompt = prompts(1, 10, seed=8)[0]
    old = asyncio.run(_prefill(cluster.prefill_address, prompt))
    cluster.restart_prefill()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(_generate(cluster.decode_address, prompt, old))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    d = cluster.stats("decode")
    assert d.free_kv_blocks == d.total_kv_blocks
    # and the cluster serves through the new incarnation
    r = cluster.complete(prompt=prompt, max_tokens=4, temperature=0, ignore_eos=True)
    assert r.status_code == 200, r.text
