"""The decode node's side of a KV ticket's lease on the prefill node (docs/architecture.md#handoff): how D asks P
to extend or release it, and the extension in flight while D reserves blocks and pulls."""

from __future__ import annotations

import asyncio
from typing import Protocol

from wire import KVTicket


class LeaseClient(Protocol):
    """How D talks to P about a ticket (over gRPC: clients.py)."""

    async def extend(self, ticket: KVTicket, seconds: float) -> bool:
        """Extends the ticket's lease on P; False when the ticket is not live there."""

    async def release(self, ticket: KVTicket) -> bool:
        """Frees the ticket's blocks on P."""


class LeaseCheck:
    """D's extension of a ticket's lease on P, in flight while D reserves and pulls."""

    def __init__(self, future: asyncio.Future[bool]) -> None:
        self.future = future
        # set on the event loop, read on the engine thread (a plain attribute: no asyncio call from there)
        self.confirmed = False
        future.add_done_callback(self._answered)

    def _answered(self, future: asyncio.Future[bool]) -> None:
        self.confirmed = not future.cancelled() and future.exception() is None and future.result() is True

    @property
    def answered_not_live(self) -> bool:
        return self.future.done() and not self.confirmed

    async def live(self) -> bool:
        try:
            return bool(await asyncio.shield(self.future))
        except Exception:  # noqa: BLE001 - the lease client reports RPC failures as False; anything else: not live
            return False
