"""The simulator's inputs and outputs (benchmark/sim/__init__.py documents the API)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from benchmark.client import RequestOutput
from benchmark.metrics import BenchmarkMetrics
from cluster.planner.types import Decision, LoadWindow, PoolSizes


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float  # seconds from the run's start
    prompt_tokens: int
    output_tokens: int


class Controller(Protocol):
    """The planner's policy as the simulator drives it (cluster/planner/policy.py)."""

    def decide(self, now: float, window: LoadWindow, current: PoolSizes) -> Decision: ...


@dataclass(frozen=True)
class TimelinePoint:
    t: float
    serving: PoolSizes  # nodes taking requests (ready, not draining)
    alive: PoolSizes  # nodes counting node-seconds (starting, serving or draining)


@dataclass
class SimResult:
    metrics: BenchmarkMetrics
    outputs: list[RequestOutput]  # in the order of the requests given
    colocated: list[bool]
    duration_s: float
    prefill_node_seconds: float
    decode_node_seconds: float
    timeline: list[TimelinePoint] = field(default_factory=list)
    windows: list[LoadWindow] = field(default_factory=list)
    decisions: list[tuple[float, Decision]] = field(default_factory=list)

    @property
    def node_seconds(self) -> float:
        return self.prefill_node_seconds + self.decode_node_seconds
