"""Starting a node: logging, the engine thread, the gRPC server, and a draining stop on SIGTERM/SIGINT.

How a node leaves (scale-down, rolling restart) without failing a request:
1. The first SIGTERM/SIGINT starts the drain. `on_drain` runs: the node leaves the registry (or marks itself
   draining there), so routers stop choosing it.
2. For `DrainPolicy.announce_s` the node keeps serving everything, new RPCs included: a router that chose it
   just before it left may still send a request (the registry is polled, not pushed).
3. It then waits until it is idle: no RPC in flight and no request in the engine. On a prefill node that
   includes pinned KV tickets: a decode node is still to pull their blocks and release them, so the KV
   transfer endpoint and the Release/ExtendLease RPCs must stay up until then. At most `timeout_s`
   (`--drain-timeout`, which `tandem serve` sets from its own setting: the pool waits that long, plus a margin).
4. The gRPC server stops with a short grace (anything still in flight gets it), then the engine and the
   connector stop. A second signal skips the wait.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from engine.async_engine import AsyncEngine
from node_common.health import NodeHealth
from node_common.metrics import serve_node_metrics
from node_common.registrar import StorePuts, registration
from node_common.tls import TLSFileError, server_credentials
from wire import NodeIdentity, Role

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DrainPolicy:
    timeout_s: float  # give up waiting for in-flight work after this long (--drain-timeout)
    announce_s: float = 2.0  # keep taking new RPCs this long after on_drain (routers' view lags the registry)
    grace_s: float = 5.0  # what RPCs still in flight get when the server finally stops
    poll_s: float = 0.05


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"


class InFlightRPCs(grpc.aio.ServerInterceptor):
    """Counts the RPCs being served, streams included, so a drain knows when the last one has finished."""

    def __init__(self) -> None:
        self.count = 0

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        if details.method.startswith(HEALTH_METHOD_PREFIX):
            return handler  # probes are not work: a health Watch stream must not hold a drain open
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._count_unary(handler.unary_unary), request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._count_stream(handler.unary_stream), request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return handler  # the nodes have no client-streaming RPCs

    def _count_unary(self, method: Callable[[Any, Any], Awaitable[Any]]) -> Callable[[Any, Any], Awaitable[Any]]:
        async def counted(request: Any, context: Any) -> Any:
            self.count += 1
            try:
                return await method(request, context)
            finally:
                self.count -= 1

        return counted

    def _count_stream(self, method: Callable[[Any, Any], AsyncIterator[Any]]
                      ) -> Callable[[Any, Any], AsyncIterator[Any]]:
        async def counted(request: Any, context: Any) -> AsyncIterator[Any]:
            self.count += 1
            try:
                async for response in method(request, context):
                    yield response
            finally:
                self.count -= 1

        return counted


class UndecodableRequests(grpc.aio.ServerInterceptor):
    """Answers a request whose bytes are not a message of its method's type (truncated, garbled, a string field
    that is not UTF-8) with INVALID_ARGUMENT and the parser's reason. gRPC itself would answer UNKNOWN, a status
    that says nothing of whose fault it is, with a traceback in the node's log."""

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def parsed_unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
                return await unary(await _parse(parse, raw, context), context)

            return grpc.unary_unary_rpc_method_handler(parsed_unary,
                                                       response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            stream = handler.unary_stream

            async def parsed_stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async for response in stream(await _parse(parse, raw, context), context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(parsed_stream,
                                                        response_serializer=handler.response_serializer)
        return handler  # the nodes have no client-streaming RPCs


async def _parse(parse: Callable[[bytes], Any], raw: bytes, context: grpc.aio.ServicerContext) -> Any:
    try:
        return parse(raw)
    except DecodeError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid message: {e}")


def add_port(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Binds `address`: TLS only with `credentials` (no plaintext port beside it), else plaintext. The port bound;
    0 when it cannot be."""
    if credentials is not None:
        return server.add_secure_port(address, credentials)
    return server.add_insecure_port(address)


async def serve(engine: AsyncEngine, add_services: Callable[[grpc.aio.Server], None], host: str, port: int,
                on_stop: Callable[[], None], drain: DrainPolicy,
                on_drain: Callable[[], Awaitable[None]] | None = None,
                credentials: grpc.ServerCredentials | None = None, health: NodeHealth | None = None) -> None:
    """Serves until SIGTERM/SIGINT, then drains (see the module docstring) and stops. With `credentials` the port
    speaks TLS only (node_common/tls.py).

    `on_drain` takes the node out of routing (registry); without one nobody can be told, so the node does
    not wait `announce_s` and only lets the work it already has finish.
    """
    in_flight = InFlightRPCs()
    server = grpc.aio.server(interceptors=[in_flight, UndecodableRequests()],
                             options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.max_send_message_length", 64 << 20)])
    add_services(server)
    if health is not None:
        health.add_to(server)
    if add_port(server, f"{host}:{port}", credentials) == 0:
        raise SystemExit(f"cannot listen on {host}:{port}")
    engine.start()
    if health is not None:
        await health.start()
    await server.start()
    # the line tests and operators wait for
    logger.info("serving on %s:%d%s", host, port, " (TLS)" if credentials is not None else "")
    print(f"READY {host}:{port}", flush=True)

    signals = asyncio.Queue[int]()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    await signals.get()
    logger.info("draining: %d RPCs in flight; finishing them before stopping", in_flight.count)
    if health is not None:
        await health.drain()
    drained = asyncio.create_task(_drain(engine, in_flight, on_drain, drain))
    second_signal = asyncio.create_task(signals.get())
    done, _ = await asyncio.wait({drained, second_signal}, return_when=asyncio.FIRST_COMPLETED)
    if second_signal in done:
        logger.warning("second signal: stopping without waiting for in-flight requests")
        drained.cancel()
        grace = 0.0
    else:
        second_signal.cancel()
        grace = drain.grace_s
    if health is not None:
        await health.stop()
    await server.stop(grace=grace)
    engine.stop()
    on_stop()
    logger.info("stopped")


async def _drain(engine: AsyncEngine, in_flight: InFlightRPCs, on_drain: Callable[[], Awaitable[None]] | None,
                 drain: DrainPolicy) -> None:
    started = time.monotonic()
    if on_drain is not None:
        try:
            await asyncio.wait_for(on_drain(), timeout=10.0)
        except Exception:  # noqa: BLE001 - leaving the registry failed: its TTL still takes the node out
            logger.exception("leaving the registry failed; waiting for the registry entry to expire instead")
        await asyncio.sleep(drain.announce_s)
    while time.monotonic() - started < drain.timeout_s:
        if in_flight.count == 0 and await _engine_idle(engine):
            logger.info("drained in %.1f s", time.monotonic() - started)
            return
        await asyncio.sleep(drain.poll_s)
    logger.warning("drain timed out after %.0f s with %d RPCs in flight", drain.timeout_s, in_flight.count)


async def _engine_idle(engine: AsyncEngine) -> bool:
    """No request in the engine: running, waiting, or finished with pinned KV blocks (a prefill node's
    tickets that a decode node has not pulled and released yet)."""
    if not engine.healthy:
        return True  # a dead engine finishes nothing: waiting longer helps no one
    return await engine.call(lambda e: not e.requests)


# the node's gRPC service by role: the name a gRPC health check may ask about (tests compare it with protos)
SERVICE_NAMES = {Role.PREFILL: "tandem.v1.PrefillService", Role.DECODE: "tandem.v1.DecodeService"}


def run_node(args: Any, engine: AsyncEngine, identity: NodeIdentity,
             add_services: Callable[[grpc.aio.Server], None], on_stop: Callable[[], None],
             store: StorePuts | None = None) -> None:
    """Serves a node until SIGTERM/SIGINT, registered in the cluster registry when `--registry` is given (with
    `store`, the node's store tier, whose puts the registry learns).

    `on_stop` closes the KV transfer agent; the caller has registered the KV pool with it before this call (the
    node's metadata exists), so the agent counts as up until `on_stop` runs (node_common/health.py)."""

    try:
        credentials = server_credentials(args.cluster.tls.server)
    except TLSFileError as e:
        raise SystemExit(f"cannot serve TLS: {e}") from None

    transfer_open = [True]

    def stop() -> None:
        transfer_open[0] = False
        on_stop()

    async def run() -> None:
        async with registration(args, engine, identity, store) as registrar:
            if getattr(args, "metrics_port", None):
                incarnation = registrar.identity.incarnation if registrar is not None else identity.incarnation
                serve_node_metrics(args.host, args.metrics_port, identity, incarnation)
            health = NodeHealth(engine, SERVICE_NAMES[identity.role], lambda: transfer_open[0], registrar)
            # on SIGTERM the node is marked draining in the registry first, so the proxy stops choosing it
            await serve(engine, add_services, args.host, args.port, stop,
                        DrainPolicy(timeout_s=args.cluster.drain_timeout),
                        on_drain=registrar.set_draining if registrar is not None else None, credentials=credentials,
                        health=health)

    asyncio.run(run())
