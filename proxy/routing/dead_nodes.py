"""The proxy's dead-node cache: nodes it just failed to reach, kept out of routing for a short back-off.

A registry entry outlives its node by up to the TTL, and a static node leaves only after failed polls: without
this cache every request routed meanwhile would try the dead node first. A call that finds a node unreachable
(connection refused or reset: gRPC UNAVAILABLE from the transport, not an answer of the node) marks it down at
once, for `base_s`, doubled for each failure in a row up to `max_s`. When the back-off ends the node is offered
again: the next request that tries it fails fast and is retried elsewhere (a dead node costs a connection
attempt, no error to a client), or it succeeds and the node is alive. Any sign of life clears the mark: a call
that succeeds, a good poll, a new incarnation in the registry.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class _Down:
    until: float
    failures: int


@dataclass
class DeadNodes:
    base_s: float = 1.0
    max_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    _down: dict[str, _Down] = field(default_factory=dict, repr=False)  # by node address

    def mark_down(self, address: str) -> float:
        """Records a failure to reach `address`; returns how long it stays out of routing from now (seconds).
        Failures during a back-off (requests that were in flight together) do not lengthen it: only a node still
        dead when offered again does."""
        now = self.clock()
        down = self._down.get(address)
        if down is not None and now < down.until:
            return down.until - now
        failures = down.failures + 1 if down is not None else 1
        back_off = min(self.max_s, self.base_s * 2 ** (failures - 1))
        self._down[address] = _Down(now + back_off, failures)
        return back_off

    def mark_alive(self, address: str) -> None:
        self._down.pop(address, None)

    def is_down(self, address: str) -> bool:
        """True during the back-off; after it the node is offered again (the failure count stays until a sign of
        life, so that a node still dead is left out for longer next time)."""
        down = self._down.get(address)
        return down is not None and self.clock() < down.until
