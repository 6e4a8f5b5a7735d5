"""Which nodes the proxy has given up on, and the attempts in flight there that must hear of it at once.

An attempt is one RPC of a request to one node (a Prefill, or a Generate stream). While it runs it holds a
`Watch` on its node. The proxy gives a node up ("loses" it) when
- it fails FAILED_CHECKS_TO_LOSE health checks in a row: Health not answered within the check's timeout, or
  answered "not ready". The directory checks static nodes always, and registered nodes while attempts are in
  flight on them (a registered node is otherwise known by its heartbeats);
- a call finds it unreachable (the dead-node cache marks it down: proxy.routing.dead_nodes).
Every watch on a lost node is marked lost and the await it is in is interrupted, so that the attempt can cancel
its RPC and be retried elsewhere (proxy.routing.attempts) instead of waiting out a frozen node or the request's
deadline.

Why health checks and not short RPC timeouts: a frozen node (SIGSTOP, a hung host, a partition) answers
nothing, not even Health; a busy node answers Health at once, since the gRPC edge never waits for its engine
thread (Stats does: it is not a liveness check). A Prefill of a long prompt behind a queue may take minutes,
so an RPC timeout short enough to catch a freeze would also fire on honest work.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Iterator

import grpc

from proxy.routing.clients import NodeHealth

FAILED_CHECKS_TO_LOSE = 2


class Watch:
    """One attempt's interest in a node. `lost_because` is set when the proxy gives the node up meanwhile."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.lost_because: str | None = None
        self._scope: asyncio.Timeout | None = None  # the await to interrupt while the attempt waits on the node

    @property
    def lost(self) -> bool:
        return self.lost_because is not None

    @contextlib.contextmanager
    def interruptible(self, scope: asyncio.Timeout) -> Iterator[None]:
        """Marks the timeout scope (entered) whose await a loss interrupts; outside it, the attempt checks
        `lost` itself before it waits again."""
        self._scope = scope
        try:
            yield
        finally:
            self._scope = None

    def lose(self, reason: str) -> None:
        if self.lost_because is None:
            self.lost_because = reason
        if self._scope is not None and not self._scope.expired():
            self._scope.reschedule(asyncio.get_running_loop().time())  # fires at the next turn of the loop


class Liveness:
    """Consecutive failed health checks per node address, and the watches of the attempts in flight.
    `polled`: addresses checked all the time (static nodes); the others are checked only while watched, and
    their count starts again with each such spell."""

    def __init__(self, polled: Iterable[str] = (), failed_checks_to_lose: int = FAILED_CHECKS_TO_LOSE) -> None:
        self.polled = frozenset(polled)
        self.failed_checks_to_lose = failed_checks_to_lose
        self._watches: dict[str, set[Watch]] = {}
        self._failed_checks: dict[str, int] = {}

    @contextlib.contextmanager
    def watch(self, address: str) -> Iterator[Watch]:
        watch = Watch(address)
        self._watches.setdefault(address, set()).add(watch)
        try:
            yield watch
        finally:
            watches = self._watches.get(address)
            if watches is not None:
                watches.discard(watch)
                if not watches:
                    del self._watches[address]
                    if address not in self.polled:
                        self._failed_checks.pop(address, None)

    def to_check(self) -> list[str]:
        """Addresses not polled anyway that attempts are in flight on: each round of checks takes them too."""
        return sorted(a for a in self._watches if a not in self.polled)

    def check_passed(self, address: str) -> None:
        self._failed_checks.pop(address, None)

    def check_failed(self, address: str, reason: str) -> bool:
        """Records a failed health check; True when the node is given up (every attempt on it is told, again at
        each further failed check: attempts sent to a node already failing are not left there either)."""
        failures = self._failed_checks.get(address, 0) + 1
        self._failed_checks[address] = failures
        if failures < self.failed_checks_to_lose:
            return False
        self.lose(address, f"{reason} ({failures} health checks failed in a row)")
        return True

    def lose(self, address: str, reason: str) -> None:
        """Tells every attempt in flight on `address` that the proxy gave the node up."""
        for watch in list(self._watches.get(address, ())):
            watch.lose(reason)


def check_failure(answer: NodeHealth | BaseException) -> str | None:
    """Why a health check failed, from its answer or its RPC error (None: it passed)."""
    if isinstance(answer, grpc.aio.AioRpcError):
        return f"Health not answered ({answer.code().name})"
    if isinstance(answer, BaseException):
        raise answer  # a bug, not an answer
    return None if answer.ready else "the node reports it is not ready"
