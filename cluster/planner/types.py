"""What the planner sees and decides, shared by its live loop (cluster/planner/loop.py) and the simulator
(benchmark/sim/), so that one policy (cluster/planner/policy.py) is what both run."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SLO:
    """Latency objectives, each at a percentile of the requests (vLLM's and DistServe's shape)."""

    ttft_s: float
    itl_s: float
    percentile: float = 90.0


@dataclass(frozen=True)
class PoolSizes:
    prefill: int
    decode: int

    @property
    def total(self) -> int:
        return self.prefill + self.decode


@dataclass(frozen=True)
class LoadWindow:
    """One observation interval, as the proxy's metrics (or the simulator) saw it."""

    start_s: float
    duration_s: float
    arrivals: int  # requests that arrived in the interval
    prompt_tokens: int  # their prompt tokens
    output_tokens: int  # tokens generated in the interval (all requests)
    completed: int  # requests that finished in the interval
    ttft_s: float | None  # TTFT at the SLO's percentile over the interval's first tokens; None: none
    itl_s: float | None  # inter-token latency at the SLO's percentile; None: none
    running: int  # requests in flight at the interval's end
    waiting_prefill_tokens: int = 0  # prompt tokens queued on prefill nodes at the end

    @property
    def rate(self) -> float:
        return self.arrivals / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def mean_prompt_tokens(self) -> float:
        return self.prompt_tokens / self.arrivals if self.arrivals else 0.0


@dataclass(frozen=True)
class Decision:
    """The pool sizes the planner wants, and why, in words (logged, and exported as a metric's label)."""

    sizes: PoolSizes
    reason: str
    changed: bool
    actions: tuple[PoolAction, ...] = ()  # per pool, for the log line and the decision metrics


@dataclass(frozen=True)
class PoolAction:
    """What the planner did with one pool in one decision: `cause` is a short code (a metric label: load,
    in_flight, queue, slo_ttft, slo_itl, idle, min, max, cooldown, steady, hysteresis), `detail` the numbers in
    words."""

    role: str  # "prefill" | "decode"
    current: int
    desired: int
    cause: str
    detail: str

    @property
    def direction(self) -> str:
        return "up" if self.desired > self.current else "down" if self.desired < self.current else "hold"
