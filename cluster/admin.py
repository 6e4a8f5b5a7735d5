"""The admin API of a running `tandem serve`, on 127.0.0.1, behind a bearer token.

    GET  /status                             -> {"pools": {"prefill": {"desired", "ready", ...}, "decode": {...}}}
    POST /scale {"prefill": N, "decode": M}  -> 202 and the status (either key may be left out)

Scaling is asynchronous: `/scale` sets the desired sizes and the pools' control loop starts or drains nodes.

The admin token is its own secret ($TANDEM_ADMIN_TOKEN, else a random one written to the state file), never one of
the proxy's client API keys: a request without it gets 401, one bearing a client key 403 (a client is known, but not
allowed to scale). Errors carry the OpenAI error envelope, as the proxy's do.
"""

from __future__ import annotations

import contextlib
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
from proxy.api.auth import APIKeys, bearer_token

MAX_POOL_SIZE = 256


def new_token() -> str:
    return secrets.token_urlsafe(32)


def status_body(pools: PoolManager, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"pools": {role: asdict(status) for role, status in pools.status().items()}}
    body["nodes"] = [{"node_id": n.node_id, "role": n.role, "state": n.state.value, "address": n.address,
                      **({"error": n.error} if n.error else {})} for n in pools.nodes]
    return {**body, **(extra or {})}


def create_admin_app(pools: PoolManager, token: str, on_scale: Callable[[], None] | None = None,
                     extra_status: dict[str, Any] | None = None, client_keys: APIKeys | None = None) -> Starlette:
    """`on_scale` wakes the control loop; `extra_status` (proxy URL, model) is added to /status; `client_keys`
    (the proxy's) are told apart from a wrong token (403, not 401)."""
    admin = APIKeys([token])
    clients = client_keys or APIKeys()

    def error(status: int, message: str, code: str, kind: str = "invalid_request_error",
              headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}},
                            status_code=status, headers=headers)

    def refusal(request: Request) -> JSONResponse | None:
        given = bearer_token(request.headers)
        if given is not None and admin.matches(given):
            return None
        if given is not None and clients.matches(given):
            return error(403, "a client API key does not grant admin access: use the admin token", "forbidden",
                         "permission_error")
        return error(401, "missing or wrong admin token (Authorization: Bearer ...)", "invalid_admin_token",
                     "authentication_error", {"WWW-Authenticate": "Bearer"})

    def bad(message: str) -> JSONResponse:
        return error(400, message, "invalid_request")

    async def status(request: Request) -> Response:
        if (refused := refusal(request)) is not None:
            return refused
        return JSONResponse(status_body(pools, extra_status))

    async def scale(request: Request) -> Response:
        if (refused := refusal(request)) is not None:
            return refused
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return bad("the body must be JSON, e.g. {\"decode\": 2}")
        if not isinstance(body, dict) or not body or set(body) - set(ROLES):
            return bad(f"the body must map some of {', '.join(ROLES)} to node counts")
        for role, size in body.items():
            if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_POOL_SIZE:
                return bad(f"{role}: a node count in 0..{MAX_POOL_SIZE}, got {size!r}")
        try:
            pools.scale(body)
        except ValueError as e:
            return bad(str(e))
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
