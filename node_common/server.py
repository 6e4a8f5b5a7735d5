"""Starting a node: logging, the engine thread, the gRPC server, and a clean stop on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

import grpc

from engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


async def serve(engine: AsyncEngine, add_services: Callable[[grpc.aio.Server], None], host: str, port: int,
                on_stop: Callable[[], None]) -> None:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.max_send_message_length", 64 << 20)])
    add_services(server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise SystemExit(f"cannot listen on {host}:{port}")
    engine.start()
    await server.start()
    # the line tests and operators wait for
    logger.info("serving on %s:%d", host, port)
    print(f"READY {host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("stopping")
    await server.stop(grace=2)
    engine.stop()
    on_stop()
