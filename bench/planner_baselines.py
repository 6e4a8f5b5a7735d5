"""The baseline the planner is measured against: per-pool threshold autoscaling, as the Helm chart's KEDA
triggers do it (deploy/helm/tandem/values.yaml: prefill on queued prompt tokens per replica, decode on running
requests per replica), with HPA's rule: desired = ceil(current x metric per node / target), no change within a 10%
tolerance, scale-down to the highest recommendation of a stabilisation window. It has the planner's
`decide(now, window, current) -> Decision` shape, so the simulator and the live loop (cluster/planner/loop.py)
drive it as they drive the planner."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from benchmark.profile import Profile
from cluster.planner.capacity import decode_batch
from cluster.planner.types import SLO, Decision, LoadWindow, PoolAction, PoolSizes


@dataclass(frozen=True)
class _Config:
    slo: SLO


@dataclass
class ThresholdAutoscaler:
    """Per-pool threshold scaling, as KEDA/HPA do it: each pool on its own metric, no model of the other pool."""

    prefill_target_tokens: float  # queued prompt tokens per prefill node
    decode_target_running: float  # running requests per decode node
    min_sizes: PoolSizes
    max_sizes: PoolSizes
    stabilisation_s: float  # scale down to the highest recommendation of this window (HPA's default: 300 s)
    tolerance: float = 0.1

    slo: SLO = SLO(1.0, 1.0)
    planned_rate: float = 0.0  # what the live loop's metrics read (a threshold scaler plans no rate)
    _history: dict[str, deque[tuple[float, int]]] = field(
        default_factory=lambda: {"prefill": deque(), "decode": deque()})

    @property
    def config(self) -> _Config:
        return _Config(self.slo)

    @classmethod
    def for_profile(cls, profile: Profile, slo: SLO, min_sizes: PoolSizes, max_sizes: PoolSizes,
                    stabilisation_s: float, context: int = 512) -> ThresholdAutoscaler:
        """Targets an operator would set from the same profile: two full prefill steps queued per prefill node
        (the chart's default 4096 at the default budget), and 80% of the batch a decode node runs within the
        ITL SLO."""
        batch = decode_batch(profile, context, context * 2, slo.itl_s)
        return cls(prefill_target_tokens=float(profile.node.max_num_batched_tokens * 2),
                   decode_target_running=max(1.0, 0.8 * batch), min_sizes=min_sizes, max_sizes=max_sizes,
                   stabilisation_s=stabilisation_s, slo=slo)

    def decide(self, now: float, window: LoadWindow, current: PoolSizes) -> Decision:
        metrics = {"prefill": (window.waiting_prefill_tokens, self.prefill_target_tokens),
                   "decode": (window.running, self.decode_target_running)}
        actions = []
        for role, (total, target) in metrics.items():
            nodes = getattr(current, role)
            ratio = (total / max(nodes, 1)) / target
            wanted = nodes if abs(ratio - 1) <= self.tolerance else math.ceil(nodes * ratio)
            low, high = getattr(self.min_sizes, role), getattr(self.max_sizes, role)
            wanted = min(max(wanted, low), high)
            history = self._history[role]
            history.append((now, wanted))
            while history and history[0][0] < now - self.stabilisation_s:
                history.popleft()
            desired = wanted if wanted >= nodes else min(nodes, max(w for _, w in history))
            actions.append(PoolAction(role, nodes, desired, "threshold", f"{total} / {nodes} vs {target}"))
        sizes = PoolSizes(actions[0].desired, actions[1].desired)
        return Decision(sizes, "threshold", sizes != current, tuple(actions))


