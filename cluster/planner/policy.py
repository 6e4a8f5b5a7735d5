"""The planner's policy: from the last interval's load to the pool sizes for the next (pure: no I/O, no clock;
the live loop (loop.py) and the simulator (benchmark/sim) drive the same object).

Each interval:
1. Prediction: EWMAs of the arrival rate and of the prompt and output lengths, the rate with a short-term trend
   (an EWMA of its change); the rate planned for is the larger of the prediction and the last observed rate.
2. Sizing from the capacity model (capacity.py) at the predicted lengths, each node run at most at `utilisation`
   of its capacity; floors from the work in flight (running requests / a decode node's batch; queued prompt
   tokens / what a prefill node computes within the TTFT SLO); a correction from the observed latencies: a pool
   whose SLO the interval missed gets at least current x observed / SLO nodes (capped at twice as many).
3. Rules: min/max per pool; a pool grows at once, but shrinks only when the smaller size would run below
   `low_watermark` of its capacity (and no SLO was missed) for `down_windows` consecutive intervals that span at
   least `down_after_s` (default: one cooldown; HPA's scale-down stabilisation: with short intervals a few quiet
   ones in a row are noise, not a trend); at most one change per pool per `cooldown_s`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from benchmark.profile import Profile
from cluster.planner.capacity import Load, NodeCapacity, capacity
from cluster.planner.types import SLO, Decision, LoadWindow, PoolAction, PoolSizes

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class PolicyConfig:
    slo: SLO
    min_sizes: PoolSizes = PoolSizes(1, 1)
    max_sizes: PoolSizes = PoolSizes(8, 8)
    cooldown_s: float = 60.0
    utilisation: float = 0.8  # the share of a node's capacity the sizing plans for
    low_watermark: float = 0.6  # shrink only when the smaller size would run below this share
    down_windows: int = 3  # ... for this many consecutive intervals
    down_after_s: float | None = None  # ... spanning at least this long (None: cooldown_s)
    alpha: float = 0.5  # EWMA weight of the newest interval
    trend_alpha: float = 0.3
    max_correction: float = 2.0  # the SLO correction asks for at most this many times the current nodes
    colocate_max_tokens: int = 0  # the proxy's threshold: prompts up to it are prefilled on decode nodes
    default_input_len: float = 512.0  # lengths assumed before the first request is seen
    default_output_len: float = 128.0


@dataclass
class _Predictor:
    alpha: float
    trend_alpha: float
    rate: float | None = None
    trend: float = 0.0
    input_len: float | None = None
    output_len: float | None = None

    def observe(self, window: LoadWindow) -> None:
        rate = window.rate
        if self.rate is None:
            self.rate = rate
        else:
            previous = self.rate
            self.rate = self.alpha * rate + (1 - self.alpha) * self.rate
            self.trend = self.trend_alpha * (self.rate - previous) + (1 - self.trend_alpha) * self.trend
        if window.arrivals:
            self.input_len = _ewma(self.input_len, window.mean_prompt_tokens, self.alpha)
        if window.completed and window.output_tokens:
            self.output_len = _ewma(self.output_len, window.output_tokens / window.completed, self.alpha)

    def next_rate(self, last: float) -> float:
        predicted = (self.rate or 0.0) + max(self.trend, 0.0)
        return max(predicted, last)


def _ewma(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else alpha * new + (1 - alpha) * old


@dataclass
class _PoolState:
    last_change_s: float = -math.inf
    low_windows: int = 0
    low_since_s: float = math.inf  # start of the first of those intervals


@dataclass
class Planner:
    """decide(now, window, current) -> Decision, one call per interval."""

    profile: Profile
    config: PolicyConfig
    planned_rate: float = field(init=False, default=0.0)  # the rate the last decision sized for
    _predictor: _Predictor = field(init=False)
    _pools: dict[str, _PoolState] = field(init=False)

    def __post_init__(self) -> None:
        self._predictor = _Predictor(self.config.alpha, self.config.trend_alpha)
        self._pools = {role: _PoolState() for role in ROLES}

    def decide(self, now: float, window: LoadWindow, current: PoolSizes) -> Decision:
        c = self.config
        self._predictor.observe(window)
        rate = self.planned_rate = self._predictor.next_rate(window.rate)
        load = Load(rate, self._predictor.input_len or c.default_input_len,
                    self._predictor.output_len or c.default_output_len)
        cap = capacity(self.profile, c.slo, load, c.colocate_max_tokens)
        actions = tuple(self._decide_pool(role, now, window, getattr(current, role), load, cap) for role in ROLES)
        sizes = PoolSizes(actions[0].desired, actions[1].desired)
        reason = (f"load {window.rate:.2f} req/s observed, {rate:.2f} planned (prompt {load.input_len:.0f}, "
                  f"output {load.output_len:.0f} tokens); " + "; ".join(f"{a.role} {a.current}->{a.desired} "
                                                                        f"[{a.cause}] {a.detail}" for a in actions))
        return Decision(sizes, reason, sizes != current, actions)

    def _decide_pool(self, role: str, now: float, window: LoadWindow, current: int, load: Load,
                     cap: NodeCapacity) -> PoolAction:
        c = self.config
        state = self._pools[role]
        needs = self._needs(role, window, current, load, cap)
        cause, want = max(needs.items(), key=lambda kv: kv[1])
        low, high = getattr(c.min_sizes, role), getattr(c.max_sizes, role)
        bounded = min(max(want, low), high)
        detail = ", ".join(f"{k} {v}" for k, v in needs.items())
        if bounded != want:
            cause = "max" if want > high else "min"
        if bounded == current:
            state.low_windows, state.low_since_s = 0, math.inf
            return PoolAction(role, current, current, "steady", detail)
        cooling = now - state.last_change_s < c.cooldown_s
        if bounded > current:
            state.low_windows, state.low_since_s = 0, math.inf
            if cooling:
                left = c.cooldown_s - (now - state.last_change_s)
                return PoolAction(role, current, current, "cooldown", f"wants {bounded}, {left:.0f} s of cooldown "
                                  f"left; {detail}")
            state.last_change_s = now
            return PoolAction(role, current, bounded, cause, detail)
        # smaller: only with a margin, for a while, and never below what runs now
        utilisation = self._utilisation(role, bounded, window, load, cap)
        slo_missed = "slo_ttft" in needs or "slo_itl" in needs
        if utilisation <= c.low_watermark and not slo_missed:
            state.low_windows += 1
            state.low_since_s = min(state.low_since_s, now - window.duration_s)
        else:
            state.low_windows, state.low_since_s = 0, math.inf
        low_for = now - state.low_since_s if state.low_windows else 0.0
        down_after = c.cooldown_s if c.down_after_s is None else c.down_after_s
        if state.low_windows < c.down_windows or low_for < down_after:
            return PoolAction(role, current, current, "hysteresis",
                              f"{bounded} nodes would run at {utilisation:.0%} ({state.low_windows}/{c.down_windows}"
                              f" intervals, {low_for:.0f}/{down_after:.0f} s below {c.low_watermark:.0%}); {detail}")
        if cooling:
            return PoolAction(role, current, current, "cooldown", f"wants {bounded}; {detail}")
        state.last_change_s = now
        state.low_windows, state.low_since_s = 0, math.inf
        return PoolAction(role, current, bounded, "idle" if cause == "load" else cause,
                          f"{bounded} nodes run at {utilisation:.0%}; {detail}")

    def _needs(self, role: str, window: LoadWindow, current: int, load: Load, cap: NodeCapacity) -> dict[str, int]:
        """Nodes each rule asks for: the load, the work in flight, the observed SLO misses."""
        c = self.config
        sized = cap.nodes(load.rate, c.utilisation)
        needs = {"load": getattr(sized, role) or getattr(c.max_sizes, role)}  # 0: infeasible, as many as allowed
        if role == "decode":
            if cap.decode_batch > 0:
                needs["in_flight"] = math.ceil(window.running / cap.decode_batch)
            observed, objective, name = window.itl_s, c.slo.itl_s, "slo_itl"
        else:
            within_slo = cap.prefill_tokens_per_s * c.slo.ttft_s
            if within_slo > 0 and window.waiting_prefill_tokens:
                needs["queue"] = math.ceil(window.waiting_prefill_tokens / within_slo)
            observed, objective, name = window.ttft_s, c.slo.ttft_s, "slo_ttft"
        if observed is not None and observed > objective and current > 0:
            needs[name] = math.ceil(current * min(observed / objective, c.max_correction))
            needs[name] = max(needs[name], current + 1)
        return needs

    def _utilisation(self, role: str, nodes: int, window: LoadWindow, load: Load, cap: NodeCapacity) -> float:
        """The share of `nodes` nodes' capacity the planned load (and, on D, the requests in flight) would take."""
        if nodes <= 0:
            return math.inf
        if role == "prefill":
            rate = load.rate * (1 - cap.colocated_share)
            return 0.0 if rate <= 0 else rate / (nodes * cap.prefill_rate) if cap.prefill_rate > 0 else math.inf
        by_rate = load.rate / (nodes * cap.decode_rate) if cap.decode_rate > 0 else math.inf
        by_flight = window.running / (nodes * cap.decode_batch) if cap.decode_batch > 0 else 0.0
        return max(by_rate if load.rate > 0 else 0.0, by_flight)
