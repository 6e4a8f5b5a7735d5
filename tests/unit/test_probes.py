"""What Kubernetes' probes see: a node's standard gRPC health service (node_common/health.py) answering from the
node's state over a real gRPC server, and the proxy's /ready and /live against a real redis-server."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from node_common.health import LIVENESS_SERVICE, NodeHealth
from proxy.api.app import create_app
from proxy.api.serving import ProxyState
from proxy.routing.directory import NodeDirectory
from tests.integration.processes import RedisServer
from tests.unit.test_openai_api import ScriptedPipeline

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class FakeEngine:
    healthy: bool = True  # the engine thread is alive (AsyncEngine.healthy)


@dataclass
class FakeRegistrar:
    registered: bool = False  # NodeRegistrar.registered


def test_readiness_needs_engine_transfer_agent_and_registration_and_liveness_only_the_engine():
    engine, registrar, transfer = FakeEngine(), FakeRegistrar(), {"open": True}

    async def main() -> list[tuple[int, int, int]]:
        health = NodeHealth(engine, "tandem.v1.DecodeService", lambda: transfer["open"], registrar,  # type: ignore[arg-type]
                            refresh_s=0.01)
        server = grpc.aio.server()
        health.add_to(server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await health.start()
        seen = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)

                async def statuses() -> tuple[int, int, int]:
                    await asyncio.sleep(0.05)  # a few refreshes
                    answers = [await stub.Check(health_pb2.HealthCheckRequest(service=s), timeout=5)
                               for s in ("", "tandem.v1.DecodeService", LIVENESS_SERVICE)]
                    return answers[0].status, answers[1].status, answers[2].status

                seen.append(await statuses())  # not registered yet
                registrar.registered = True
                seen.append(await statuses())  # ready
                transfer["open"] = False
                seen.append(await statuses())  # the transfer agent closed
                transfer["open"] = True
                await health.drain()
                seen.append(await statuses())  # draining
                engine.healthy = False
                seen.append(await statuses())  # the engine thread died
        finally:
            await health.stop()
            await server.stop(0)
        return seen

    assert asyncio.run(main()) == [(NOT_SERVING, NOT_SERVING, SERVING), (SERVING, SERVING, SERVING),
                                   (NOT_SERVING, NOT_SERVING, SERVING), (NOT_SERVING, NOT_SERVING, SERVING),
                                   (NOT_SERVING, NOT_SERVING, NOT_SERVING)]


def test_without_a_registry_a_node_is_ready_once_its_engine_and_agent_are():
    async def main() -> Any:
        health = NodeHealth(FakeEngine(), "tandem.v1.PrefillService", lambda: True, None)  # type: ignore[arg-type]
        await health.start()
        try:
            return health.servicer._server_status[""], health.ready()
        finally:
            await health.stop()

    assert asyncio.run(main()) == (SERVING, True)


@pytest.fixture
def proxy_state(tokenizer_dir: Path) -> ProxyState:
    from transformers import AutoTokenizer

    return ProxyState(ScriptedPipeline([5]), AutoTokenizer.from_pretrained(str(tokenizer_dir)), "m", 30.0)


def _get(state: ProxyState, *paths: str) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        app = create_app(state)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as http:
                return [await http.get(path) for path in paths]

    return asyncio.run(run())


def test_the_proxy_is_ready_while_its_registry_answers_whatever_the_nodes(proxy_state: ProxyState, tmp_path: Path):
    redis_server = RedisServer(tmp_path)
    try:
        proxy_state.pipeline.directory = NodeDirectory(registry_url=redis_server.url)
        ready, live, health = _get(proxy_state, "/ready", "/live", "/health")
        assert (ready.status_code, ready.json()) == (200, {"status": "ok"})  # no node registered: still ready
        assert health.status_code == 503  # /health still says that nothing can be served
        assert live.status_code == 200
    finally:
        redis_server.stop()
    proxy_state.pipeline.directory = NodeDirectory(registry_url=redis_server.url)
    ready, live = _get(proxy_state, "/ready", "/live")
    assert ready.status_code == 503 and ready.json()["status"] == "unavailable"
    assert "registry" in ready.json()["reason"]
    assert live.status_code == 200  # a registry outage never restarts the proxy


def test_probes_need_no_api_key(proxy_state: ProxyState):
    from proxy.api.auth import APIKeys

    proxy_state.api_keys = APIKeys(["secret"])
    ready, live, models = _get(proxy_state, "/ready", "/live", "/v1/models")
    assert ready.status_code == 200 and live.status_code == 200 and models.status_code == 401
