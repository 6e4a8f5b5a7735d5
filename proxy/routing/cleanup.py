"""Clean-up calls of a request to its nodes: aborts of attempts and releases of tickets (proxy.routing.pd).

Shield them from a cancelled request: they must go out all the same.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from proxy.routing.attempts import AttemptAbandoned
from proxy.routing.clients import NodeError
from proxy.routing.directory import NodeDirectory, NodeView
from wire import KVTicket, Role

CLEANUP_TIMEOUT_S = 2.0  # an abort or release to a node that is up


class CleanupCalls:
    """Aborts and releases, awaited on a node that is up, sent in the background to one given up on."""

    def __init__(self, directory: NodeDirectory) -> None:
        self.directory = directory
        self._background: set[asyncio.Future[None]] = set()  # clean-up calls to nodes given up on

    def cancel(self) -> None:
        """Stops the calls still in the background (the proxy is closing)."""
        for task in list(self._background):
            task.cancel()

    async def clean_up(self, decode: NodeView, attempt_id: str, holder: NodeView, ticket: KVTicket | None,
                       deadline: float) -> None:
        await self.abort(decode, attempt_id, deadline)
        if ticket is not None:
            await self.release(holder, ticket, deadline)

    async def abort_abandoned(self, node: NodeView, attempt_id: str, failure: NodeError, deadline: float) -> None:
        """A node that failed an attempt has ended it itself; one running an attempt the proxy gave up on (for its
        own sake, or for the prefill node it pulls from) may still run it."""
        if isinstance(failure, AttemptAbandoned):
            await self.abort(node, attempt_id, deadline)

    async def abort(self, node: NodeView, attempt_id: str, deadline: float) -> None:
        client = (self.directory.prefill_client(node) if node.role is Role.PREFILL
                  else self.directory.decode_client(node))
        await self._tell(node, lambda timeout: client.abort(attempt_id, timeout), deadline)

    async def release(self, node: NodeView, ticket: KVTicket, deadline: float) -> None:
        client = self.directory.prefill_client(node)
        await self._tell(node, lambda timeout: client.release(ticket, timeout), deadline)

    async def _tell(self, node: NodeView, call: Callable[[float], Awaitable[None]], deadline: float) -> None:
        """Makes a clean-up call (abort, release) to `node`: awaited while the node is up. A node given up on gets
        it in the background, with until the request's deadline to answer: nobody waits for a frozen node, and one
        that thaws still frees what it held for the request (its cancelled RPC may have finished before it saw the
        cancellation)."""
        if not self.directory.is_down(node):
            await call(CLEANUP_TIMEOUT_S)
            return
        task = asyncio.ensure_future(call(max(CLEANUP_TIMEOUT_S, deadline - time.time())))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
