"""The admin API of a running `tandem serve`, on 127.0.0.1, behind a bearer token.

    GET  /status                             -> {"pools": {"prefill": {"desired", "ready", ...}, "decode": {...}}}
    POST /scale {"prefill": N, "decode": M}  -> 202 and the status (either key may be left out)

Scaling is asynchronous: `/scale` sets the desired sizes and the pools' control loop starts or drains nodes.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import secrets
import socket
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cluster.pools import ROLES, PoolManager

MAX_POOL_SIZE = 256


def new_token() -> str:
    return secrets.token_urlsafe(32)


def status_body(pools: PoolManager, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"pools": {role: asdict(status) for role, status in pools.status().items()}}
    body["nodes"] = [{"node_id": n.node_id, "role": n.role, "state": n.state.value, "address": n.address,
                      **({"error": n.error} if n.error else {})} for n in pools.nodes]
    return {**body, **(extra or {})}


def create_admin_app(pools: PoolManager, token: str, on_scale: Callable[[], None] | None = None,
                     extra_status: dict[str, Any] | None = None) -> Starlette:
    """`on_scale` wakes the control loop; `extra_status` (proxy URL, model) is added to /status."""

    def authorized(request: Request) -> bool:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), token.encode())

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message}}, status_code=status)

    async def status(request: Request) -> Response:
        if not authorized(request):
            return error(401, "missing or wrong admin token (Authorization: Bearer ...)")
        return JSONResponse(status_body(pools, extra_status))

    async def scale(request: Request) -> Response:
        if not authorized(request):
            return error(401, "missing or wrong admin token (Authorization: Bearer ...)")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error(400, "the body must be JSON, e.g. {\"decode\": 2}")
        if not isinstance(body, dict) or not body or set(body) - set(ROLES):
            return error(400, f"the body must map some of {', '.join(ROLES)} to node counts")
        for role, size in body.items():
            if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_POOL_SIZE:
                return error(400, f"{role}: a node count in 0..{MAX_POOL_SIZE}, got {size!r}")
        try:
            pools.scale(body)
        except ValueError as e:
            return error(400, str(e))
        if on_scale is not None:
            on_scale()
        return JSONResponse(status_body(pools, extra_status), status_code=202)

    return Starlette(routes=[Route("/status", status), Route("/scale", scale, methods=["POST"])])


class AdminServer(uvicorn.Server):
    """uvicorn inside `tandem serve`'s event loop: it must leave signal handling to `tandem serve`."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        return contextlib.nullcontext()


def bind_admin_socket(port: int = 0) -> socket.socket:
    """The admin API listens on loopback only; port 0 picks a free one."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(64)
    return sock
