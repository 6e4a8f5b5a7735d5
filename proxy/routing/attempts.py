"""Attempts the proxy gives up on, so that a request never waits out a node that stopped working for it.

An attempt is one RPC of a request to one node: a Prefill, or a Generate stream. The proxy abandons it (cancels
the RPC and raises AttemptAbandoned, a retryable NodeError; proxy.routing.pd retries it elsewhere when that is safe)
when
- its node is lost (proxy.routing.liveness: failed health checks in a row, or found unreachable by another call).
  A decode attempt before its first token also depends on the prefill node it pulls the KV from: losing that
  one abandons it too. The reason is NODE_LOST, the error UNAVAILABLE and `unreachable` (routing leaves the
  node out for a back-off);
- it makes no progress within its timeout: a Prefill that does not answer within `prefill_timeout_s`, a
  Generate whose first token does not come within `first_token_timeout_s` (a colocated Generate prefills on D:
  it gets `prefill_timeout_s`). The reason is TIMEOUT, the error DEADLINE_EXCEEDED; the node stays in routing,
  since it still answers its health checks. Once a stream has started there is no per-token timeout: a long
  pause of a live node is not a failure, and the request's deadline bounds it anyway.

The defaults are generous on purpose (2 minutes each, a fifth of the default request timeout, so that an attempt
and its retries fit in it): a frozen node is caught by its health checks within seconds, and these timeouts are
only for a node that answers Health but whose engine makes no progress (a wedged thread, a transfer that never
ends). Short ones would fire on honest work: the prefill of a long prompt behind a queue, a decode node waiting
for free KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from proxy.routing.clients import NodeError
from proxy.routing.directory import NodeView
from proxy.routing.liveness import Liveness, Watch
from wire import Role

T = TypeVar("T")

DEFAULT_ATTEMPT_TIMEOUT_S = 120.0


class AbandonReason(enum.Enum):
    NODE_LOST = "node_lost"
    TIMEOUT = "timeout"


class AttemptAbandoned(NodeError):
    """The proxy gave up on an attempt (see the module docstring); `node` names the node it gave up on."""

    def __init__(self, node: NodeView, reason: AbandonReason, message: str) -> None:
        lost = reason is AbandonReason.NODE_LOST
        super().__init__(f"{node.role.value} {node.address}", grpc.StatusCode.UNAVAILABLE if lost
                         else grpc.StatusCode.DEADLINE_EXCEEDED, message, retryable=True, unreachable=lost)
        self.reason = reason

    @property
    def try_another_node(self) -> bool:
        return True


@dataclass(frozen=True)
class AttemptLimits:
    """Progress timeouts of one attempt, in seconds (None: none; the request's deadline still applies)."""

    prefill_timeout_s: float | None = DEFAULT_ATTEMPT_TIMEOUT_S
    first_token_timeout_s: float | None = DEFAULT_ATTEMPT_TIMEOUT_S


@dataclass
class AttemptCounts:
    """What /metrics reports: attempts abandoned by (node role, reason), and retries by the role of the node
    whose failure was retried."""

    abandoned: Counter[tuple[str, str]] = field(default_factory=Counter)
    retries: Counter[str] = field(default_factory=Counter)


class Attempts:
    """Runs attempts under their node's watch and their timeouts."""

    def __init__(self, liveness: Liveness, limits: AttemptLimits) -> None:
        self.liveness = liveness
        self.limits = limits
        self.counts = AttemptCounts()

    async def unary(self, node: NodeView, call: Coroutine[Any, Any, T], timeout_s: float | None) -> T:
        """The result of `call`, an RPC to `node`; AttemptAbandoned (the RPC cancelled) when the proxy gives up."""
        with self.liveness.watch(node.address) as watch:
            scope = asyncio.timeout(timeout_s)
            try:
                async with scope:
                    with watch.interruptible(scope):
                        return await call
            except TimeoutError:
                if not scope.expired():
                    raise
                raise self._abandoned(node, watch, timeout_s) from None

    async def stream(self, node: NodeView, chunks: AsyncIterator[T], first_timeout_s: float | None,
                     until_first: NodeView | None = None) -> AsyncGenerator[T, None]:
        """The items of `chunks`, a stream from `node`. Until the first item the stream is also abandoned when
        `until_first` is lost (the node D pulls the KV from) or `first_timeout_s` passes; after it, only when
        `node` is lost (what was sent stays sent: proxy.routing.migration continues the request elsewhere)."""
        with contextlib.ExitStack() as node_watch, contextlib.ExitStack() as first_watch:
            watch = node_watch.enter_context(self.liveness.watch(node.address))
            watches = [(node, watch)]
            if until_first is not None:
                watches.append((until_first, first_watch.enter_context(self.liveness.watch(until_first.address))))
            started = False
            try:
                while True:
                    lost = next(((n, w) for n, w in watches if w.lost), None)
                    if lost is not None:  # lost while the caller held the last item
                        raise self._abandoned(*lost, None)
                    scope = asyncio.timeout(None if started else first_timeout_s)
                    try:
                        async with scope:
                            with contextlib.ExitStack() as interruptible:
                                for _, w in watches:
                                    interruptible.enter_context(w.interruptible(scope))
                                item = await anext(chunks)
                    except StopAsyncIteration:
                        return
                    except TimeoutError:
                        if not scope.expired():
                            raise
                        lost_node, lost_watch = next(((n, w) for n, w in watches if w.lost), (node, watch))
                        raise self._abandoned(lost_node, lost_watch, None if started else first_timeout_s
                                              ) from None
                    if not started:
                        started = True
                        first_watch.close()  # D has the KV: the prefill node no longer matters
                        watches = watches[:1]
                    yield item
            finally:
                aclose = getattr(chunks, "aclose", None)
                if aclose is not None:
                    await aclose()  # cancels the RPC when it is still running

    def _abandoned(self, node: NodeView, watch: Watch, timeout_s: float | None) -> AttemptAbandoned:
        if watch.lost_because is not None:
            reason, message = AbandonReason.NODE_LOST, f"the proxy gave up on the node: {watch.lost_because}"
        else:
            reason, message = AbandonReason.TIMEOUT, f"no progress within the attempt's timeout ({timeout_s:g} s)"
        self.counts.abandoned[(node.role.value, reason.value)] += 1
        return AttemptAbandoned(node, reason, message)


@dataclass
class Retries:
    """A request's retries, shared by its prefill and decode attempts, and the ids its attempts go by."""

    limit: int
    request_id: str
    counts: Counter[str]  # retries by the role of the node that failed (AttemptCounts.retries)
    used: int = 0
    _num_attempts: Counter[Role] = field(default_factory=Counter, init=False)

    def spend(self, failure: NodeError) -> bool:
        """Takes one retry of `failure`; False when none is left."""
        if self.used >= self.limit:
            return False
        self.used += 1
        self.counts[failure.role] += 1
        return True

    def attempt_id(self, role: Role) -> str:
        """The request's id on the node of its next attempt of `role`: its own, then `-retryN`."""
        num_attempts = self._num_attempts[role]
        self._num_attempts[role] += 1
        return self.request_id if num_attempts == 0 else f"{self.request_id}-retry{num_attempts}"
