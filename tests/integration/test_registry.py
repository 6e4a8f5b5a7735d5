"""The Redis registry with a real redis-server: nodes register and the proxy discovers them, a node whose
heartbeats stop leaves routing, KV events reach the prefix index, and requests sharing a prefix go to the
decode node that holds it."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
import httpx
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.hashing import block_hashes
from node_common.health import LIVENESS_SERVICE
from node_common.server import SERVICE_NAMES
from protos import tandem_pb2 as pb
from protos import tandem_pb2_grpc
from proxy.routing.directory import NodeDirectory
from tests.deploy.chart import CHART, chart_queries, dashboard_queries, metric_names, render_ci
from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy
from tests.integration.processes import MooncakeMaster, Process, RedisServer, free_port, start_proxy
from wire import NodeRecord, Role, node_key

pytestmark = pytest.mark.integration
T = TypeVar("T")
BLOCK_SIZE = 4  # what processes.start_node gives nodes
HEARTBEAT_S, TTL_S = 0.5, 2.0
PREFILL_POD_UID = "6f1c2d3e-0000-4000-8000-00000000beef"


@dataclass
class Node:
    process: Process
    address: str

    @property
    def node_id(self) -> str:
        return f"node-{self.address.rsplit(':', 1)[1]}"


def directory_of(redis_server: RedisServer) -> NodeDirectory:
    return NodeDirectory(registry_url=redis_server.url, block_size=BLOCK_SIZE, hash_seed="tandem", poll_s=0.1)


@dataclass
class RegistryCluster:
    model: Path
    redis: RedisServer
    prefill: Node
    decodes: list[Node]
    proxy: Process
    url: str

    def directory(self) -> NodeDirectory:
        """A proxy's view of the cluster, in this process (start it inside the loop that uses it)."""
        return directory_of(self.redis)


def start_registered_node(role: str, model: Path, registry: str, log_dir: Path,
                          env: dict[str, str] | None = None) -> Node:
    port = free_port()
    args = ["--model", str(model), "--dtype", "float32", "--port", str(port), "--kv-backend", "nixl",
            "--block-size", str(BLOCK_SIZE), "--num-kv-blocks", "64", "--max-num-seqs", "8", "--log-level", "INFO",
            "--node-id", f"node-{port}", "--registry", registry, "--heartbeat-seconds", str(HEARTBEAT_S),
            "--registry-ttl-seconds", str(TTL_S)]
    return Node(Process(f"{role}_node", args, log_dir, env), f"127.0.0.1:{port}")


@pytest.fixture(scope="module")
def cluster(tiny_model: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryCluster]:
    model = tiny_model("llama")
    log_dir = tmp_path_factory.mktemp("registry-logs")
    server = RedisServer(log_dir)
    store = MooncakeMaster(log_dir)
    # every node with both KV tiers, set through the settings' environment layer (so every metric the dashboard
    # queries has series); the prefill node runs as a Kubernetes pod would: with its pod UID from the downward API
    tiers = {"TANDEM_KV_OFFLOADING_SIZE": "0.01", "TANDEM_KV_STORE": store.url,
             "TANDEM_KV_STORE_SEGMENT_SIZE": "0.03125"}
    nodes = [start_registered_node(role, model, server.url, log_dir, {**tiers, "TANDEM_POD_UID": PREFILL_POD_UID}
                                   if role == "prefill" else tiers) for role in ("prefill", "decode", "decode")]
    proxy = None
    try:
        for n in nodes:  # started together: they load at the same time
            n.process.wait_for_line("READY")
        proxy, url = start_proxy(model, None, None, log_dir, ["--registry", server.url, "--block-size",
                                                              str(BLOCK_SIZE), "--log-level", "info"])
        yield RegistryCluster(model, server, nodes[0], nodes[1:], proxy, url)
    finally:
        running = [n.process for n in nodes if n.process.alive] + ([proxy] if proxy else [])
        for process in running:  # drain all at once: each waits a couple of seconds after leaving routing
            os.killpg(process.popen.pid, signal.SIGCONT)
            os.killpg(process.popen.pid, signal.SIGTERM)
        for process in running:
            process.stop()
        server.stop()
        store.kill()


def run(body: Callable[[NodeDirectory], Awaitable[T]], cluster: RegistryCluster | LoneNode) -> T:
    """Runs body(directory) with a started in-process directory watching the cluster's registry."""
    async def main() -> T:
        directory = cluster.directory()
        await directory.start()
        try:
            return await body(directory)
        finally:
            await directory.close()

    return asyncio.run(main())


async def eventually(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until condition() held."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def health(address: str, service: str = "") -> int:
    """The node's answer to the standard gRPC health check (grpc.health.v1), as Kubernetes' probes ask it."""
    async with grpc.aio.insecure_channel(address) as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                   timeout=5)
        return int(response.status)


async def stats(address: str, role: Role = Role.DECODE) -> pb.StatsResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = (tandem_pb2_grpc.DecodeServiceStub if role is Role.DECODE else tandem_pb2_grpc.PrefillServiceStub)
        return await stub(channel).Stats(pb.StatsRequest(), timeout=5)


async def generate_on(address: str, prompt: list[int], max_tokens: int = 2) -> list[int]:
    """A colocated request straight to a decode node: it prefills the prompt itself (no ticket)."""
    async with grpc.aio.insecure_channel(address) as channel:
        params = pb.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0, max_tokens=max_tokens,
                                   ignore_eos=True)
        call = tandem_pb2_grpc.DecodeServiceStub(channel).Generate(pb.GenerateRequest(
            request_id=f"direct-{time.monotonic_ns()}", prompt_token_ids=prompt, params=params), timeout=30)
        return [t async for r in call for t in r.token_ids]


def hashes(prompt: list[int]) -> list[bytes]:
    return block_hashes(prompt, BLOCK_SIZE, "tandem")


def pool_hits(directory: NodeDirectory, prompt: list[int]) -> dict[str, int]:
    """Per node holding some, the prompt's leading blocks in its pool."""
    matches = directory.index.match(hashes(prompt))
    return {node_id: m.num_device for node_id, m in matches.items() if m.num_device}


def host_hits(directory: NodeDirectory, prompt: list[int]) -> dict[str, int]:
    """Per node, the prompt's blocks its host tier holds past its pool's run."""
    return {node_id: m.num_host for node_id, m in directory.index.match(hashes(prompt)).items()}


def test_registered_nodes_appear_in_the_proxys_table_with_capacity_and_load(cluster: RegistryCluster) -> None:
    async def body(directory: NodeDirectory) -> None:
        decodes = {n.address: n for n in directory.nodes(Role.DECODE)}
        prefills = directory.nodes(Role.PREFILL)
        assert set(decodes) == {n.address for n in cluster.decodes}
        assert [n.address for n in prefills] == [cluster.prefill.address]
        for state in [*decodes.values(), *prefills]:
            assert state.registered and state.prefix_aware and state.layout_hash and not state.draining
            assert (state.capacity.total_kv_blocks, state.capacity.max_num_seqs, state.capacity.block_size) == (
                64, 8, BLOCK_SIZE)
            assert state.load.free_kv_blocks == 64 and state.node_id.startswith("node-")
        assert prefills[0].layout_hash == decodes[cluster.decodes[0].address].layout_hash

    run(body, cluster)


def test_kv_events_reach_the_prefix_index_stored_and_evicted(cluster: RegistryCluster) -> None:
    node = cluster.decodes[0]
    prompt = list(range(300, 330))  # 7 full blocks
    later = list(range(500, 740))  # needs 60 of the 64 blocks: evicts some of the first prompt's

    async def body(directory: NodeDirectory) -> None:
        assert pool_hits(directory, prompt) == {}
        await generate_on(node.address, prompt)
        await eventually(lambda: pool_hits(directory, prompt) == {node.node_id: 7}, 5.0,
                         "the prompt's blocks in the index")
        await generate_on(node.address, later, max_tokens=1)
        await eventually(lambda: pool_hits(directory, later).get(node.node_id) == 60, 5.0,
                         "the new blocks in the index")
        # the pool evicts a sequence's tail first: the prompt keeps a shorter head in the index, and the evicted
        # tail went to the node's host tier, which the index learns from the host tier's own events
        kept = pool_hits(directory, prompt)[node.node_id]
        assert 0 < kept < 7
        await eventually(lambda: host_hits(directory, prompt).get(node.node_id) == 7 - kept, 5.0,
                         "the evicted blocks in the host tier's index")

    run(body, cluster)


def test_a_late_reader_loads_what_nodes_already_hold(cluster: RegistryCluster) -> None:
    node = cluster.decodes[0]
    prompt = list(range(900, 916))  # 4 full blocks, cached before this reader exists
    asyncio.run(generate_on(node.address, prompt))
    time.sleep(0.5)  # published

    async def body(directory: NodeDirectory) -> None:
        assert pool_hits(directory, prompt) == {node.node_id: 4}

    run(body, cluster)


def test_requests_sharing_a_prefix_go_to_the_decode_node_holding_it(cluster: RegistryCluster) -> None:
    # ties (no hit, same load) go to the lower address: warm the other one, so only the prefix can explain a choice
    cold, warm = sorted(cluster.decodes, key=lambda n: n.address)
    prefix = list(range(600, 632))  # 8 blocks
    before = {n.address: asyncio.run(stats(n.address)) for n in cluster.decodes}

    async def body(directory: NodeDirectory) -> None:
        await generate_on(warm.address, prefix + [5, 6, 7, 8])
        await eventually(lambda: pool_hits(directory, prefix).get(warm.node_id) == 8, 5.0,
                         "the warmed prefix in the index")

    run(body, cluster)
    time.sleep(1.0)  # the proxy reads the same stream
    warm_base = asyncio.run(stats(warm.address))
    for suffix in range(4):
        r = httpx.post(f"{cluster.url}/v1/completions", json={
            "prompt": prefix + [20 + suffix] * 6, "max_tokens": 3, "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    warm_after, cold_after = asyncio.run(stats(warm.address)), asyncio.run(stats(cold.address))
    assert warm_after.prefix_cache_hits - warm_base.prefix_cache_hits == 4 * 32
    assert cold_after.prefix_cache_queries == before[cold.address].prefix_cache_queries
    # and a prompt nobody holds goes by load, to the tie's winner
    r = httpx.post(f"{cluster.url}/v1/completions", json={
        "prompt": list(range(700, 720)), "max_tokens": 2, "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert asyncio.run(stats(cold.address)).prefix_cache_queries > cold_after.prefix_cache_queries


def test_colocated_and_disaggregated_requests_equal_transformers(cluster: RegistryCluster,
                                                                  tiny_model: TinyModelFactory) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(cluster.model))
    short, long = list(range(40, 53)), list(range(800, 890))  # 13 tokens: colocated; 90: disaggregated
    expected = hf_greedy(tiny_model("llama"), [short, long], 6)
    prefill_before = asyncio.run(stats(cluster.prefill.address, Role.PREFILL)).prefix_cache_queries
    for prompt, tokens in zip([short, long], expected, strict=True):
        r = httpx.post(f"{cluster.url}/v1/completions", json={
            "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tokenizer.decode(tokens, skip_special_tokens=True)
    # only the long prompt went through the prefill node
    assert asyncio.run(stats(cluster.prefill.address, Role.PREFILL)).prefix_cache_queries - prefill_before == len(long)
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    assert 'tandem:pd_decisions_total{mode="colocated"' in metrics
    assert 'tandem:pd_decisions_total{mode="disaggregated"' in metrics


def test_nodes_answer_the_standard_grpc_health_check_once_registered(cluster: RegistryCluster) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING

    async def check() -> None:
        for node, role in [(cluster.prefill, Role.PREFILL)] + [(d, Role.DECODE) for d in cluster.decodes]:
            assert await health(node.address) == serving  # ready: engine, transfer agent, registered
            assert await health(node.address, SERVICE_NAMES[role]) == serving
            assert await health(node.address, LIVENESS_SERVICE) == serving
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await health(cluster.prefill.address, "no.such.Service")
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

    asyncio.run(check())
    assert set(SERVICE_NAMES.values()) == {s.full_name for s in pb.DESCRIPTOR.services_by_name.values()}


def test_the_registry_record_carries_the_pod_uid_and_a_per_process_incarnation(cluster: RegistryCluster) -> None:
    client = redis.Redis.from_url(cluster.redis.url, decode_responses=True)
    try:
        prefill = NodeRecord.from_json(str(client.get(node_key(cluster.prefill.node_id))))
        decode = NodeRecord.from_json(str(client.get(node_key(cluster.decodes[0].node_id))))
    finally:
        client.close()
    assert prefill.pod_uid == PREFILL_POD_UID and decode.pod_uid == ""
    assert prefill.incarnation > 0 and decode.incarnation > 0 and prefill.incarnation != decode.incarnation
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    assert f'pod_uid="{PREFILL_POD_UID}"' in metrics  # tandem:node_info


def test_every_metric_the_chart_and_dashboard_query_is_on_a_live_proxy(cluster: RegistryCluster) -> None:
    r = httpx.post(f"{cluster.url}/v1/completions", json={"prompt": list(range(800, 890)), "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200, r.text
    samples = [line for line in httpx.get(f"{cluster.url}/metrics", timeout=10).text.splitlines()
               if line and not line.startswith("#")]
    exposed = {line.split("{", 1)[0].split(" ", 1)[0] for line in samples}
    queries = dashboard_queries() + chart_queries(render_ci(CHART / "ci" / "keda-values.yaml"))
    used = set().union(*(metric_names(q) for q in queries))
    assert len(used) >= 12
    assert used <= exposed, sorted(used - exposed)
    # how many nodes per role the proxy sees: 1 prefill and 2 decode nodes
    num_nodes = {line.split('role="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
                 for line in samples if line.startswith("tandem:num_nodes{")}
    assert num_nodes == {"prefill": 1.0, "decode": 2.0}


@dataclass
class LoneNode:
    """A registry of its own with one decode node, for a test that stops or kills the node."""

    redis: RedisServer
    node: Node

    def directory(self) -> NodeDirectory:
        return directory_of(self.redis)


@pytest.fixture
def lone_node(tiny_model: TinyModelFactory, tmp_path: Path) -> Iterator[LoneNode]:
    server = RedisServer(tmp_path)
    node = None
    try:
        node = start_registered_node("decode", tiny_model("llama"), server.url, tmp_path)
        node.process.wait_for_line("READY")
        yield LoneNode(server, node)
    finally:
        if node is not None:
            if node.process.alive:
                os.killpg(node.process.popen.pid, signal.SIGCONT)
            node.process.stop()
        server.stop()


def test_a_node_that_stops_heart_beating_leaves_routing_and_comes_back(lone_node: LoneNode) -> None:
    node = lone_node.node

    async def body(directory: NodeDirectory) -> None:
        def present() -> bool:
            return node.address in {n.address for n in directory.nodes(Role.DECODE)}

        await eventually(present, 5.0, "the node in routing")
        os.kill(node.process.popen.pid, signal.SIGSTOP)
        try:
            # the TTL after its last heartbeat, plus a margin for our poll
            await eventually(lambda: not present(), TTL_S + 1.5, "the stopped node out of routing")
            assert node.node_id not in directory.index.node_ids
        finally:
            os.kill(node.process.popen.pid, signal.SIGCONT)
        await eventually(present, 5.0, "the resumed node back in routing")

    run(body, lone_node)


def test_a_node_stopped_cleanly_drains_then_deregisters(lone_node: LoneNode) -> None:
    node = lone_node.node
    client = redis.Redis.from_url(lone_node.redis.url, decode_responses=True)

    async def body(directory: NodeDirectory) -> None:
        await eventually(lambda: node.address in {n.address for n in directory.nodes(Role.DECODE)}, 5.0,
                         "the node in routing")
        for _ in range(40):  # the health statuses refresh every 0.25 s: the registration may be newer
            if await health(node.address) == health_pb2.HealthCheckResponse.SERVING:
                break
            await asyncio.sleep(0.05)
        assert await health(node.address) == health_pb2.HealthCheckResponse.SERVING
        os.kill(node.process.popen.pid, signal.SIGTERM)
        await eventually(lambda: node.address not in {n.address for n in directory.nodes(Role.DECODE)}, 2.0,
                         "the draining node out of routing")
        record = NodeRecord.from_json(str(client.get(node_key(node.node_id))))
        assert record.draining  # still registered while it finishes its work, but chosen by no one
        # Kubernetes sees the same: not ready (no new work), still alive (not restarted while it drains)
        assert await health(node.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await health(node.address, LIVENESS_SERVICE) == health_pb2.HealthCheckResponse.SERVING

    run(body, lone_node)
    node.process.popen.wait(30)
    # gone at once, not after the TTL: the node deleted its keys on the way out
    assert client.exists(node_key(node.node_id)) == 0
    client.close()
