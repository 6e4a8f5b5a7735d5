"""The standard gRPC health service (`grpc.health.v1.Health`) on a node's port, so Kubernetes' native gRPC probes
(and grpc_health_probe, and any load balancer) can ask a node how it is.

What each service name answers, and why they differ:
- "" (the whole server) and the node's own service (`tandem.v1.PrefillService` / `tandem.v1.DecodeService`):
  readiness. SERVING only when the engine runs, the KV transfer agent has registered the KV pool and is open,
  and the node is in the registry (when it uses one), and the node is not draining. A node that is not all of
  these must not get traffic: a proxy could pick it before peers can pull its KV or find it.
- `tandem.liveness`: the engine thread is alive. Only this one may restart the container: a node whose registry
  (Redis) is down or that drains before a scale-down is not broken, and restarting it would fail requests.

The statuses are the library's servicer's (grpcio-health-checking); a small task refreshes them from the node's
state every `refresh_s`, so Check and Watch both answer from it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.async_engine import AsyncEngine
from node_common.registrar import NodeRegistrar

LIVENESS_SERVICE = "tandem.liveness"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class NodeHealth:
    """The node's health statuses; `add_to` puts the service on the node's gRPC server, `run` keeps them fresh."""

    def __init__(self, engine: AsyncEngine, service_name: str, transfer_ready: Callable[[], bool],
                 registrar: NodeRegistrar | None = None, refresh_s: float = 0.25) -> None:
        self.engine = engine
        self.transfer_ready = transfer_ready
        self.registrar = registrar
        self.refresh_s = refresh_s
        self.draining = False
        self.readiness_services = (health.OVERALL_HEALTH, service_name)
        self.servicer = health.aio.HealthServicer()
        self._task: asyncio.Task[None] | None = None

    def add_to(self, server: grpc.aio.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    def ready(self) -> bool:
        registered = self.registrar is None or self.registrar.registered
        return self.engine.healthy and self.transfer_ready() and registered and not self.draining

    async def refresh(self) -> None:
        ready = SERVING if self.ready() else NOT_SERVING
        for service in self.readiness_services:
            await self.servicer.set(service, ready)
        await self.servicer.set(LIVENESS_SERVICE, SERVING if self.engine.healthy else NOT_SERVING)

    async def start(self) -> None:
        # the library's servicer starts with "" SERVING: say the truth before the port accepts a probe
        await self.refresh()
        self._task = asyncio.create_task(self._refresh_loop(), name="grpc-health")

    async def drain(self) -> None:
        """Not ready from now on (liveness unchanged: a draining node finishes its requests)."""
        self.draining = True
        await self.refresh()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.servicer.enter_graceful_shutdown()

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()
