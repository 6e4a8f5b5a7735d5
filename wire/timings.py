"""Where a disaggregated request's time went on each node, as the node reports it to the proxy.

Durations only (seconds, each from its node's monotonic clock): clocks of different machines never meet. The proxy
turns them into its phase histograms (proxy/api/metrics.py, docs/operations.md#metrics); a node that traces also
turns them into spans (node_common/tracing.py).

    proxy ─Prefill─> P:  |<- queue ->|<- prefill ->|  first token
    proxy ─Generate─> D: |<------ handoff ------>|<- first step ->|  second token
                          lease, blocks, KV pull,
                          checksums, admission
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillTimings:
    """P's part: the RPC's arrival to the engine step that first scheduled the prompt (grammar compile, store
    fetch and the wait for a step's token budget included), then that step to the first token."""

    queue_seconds: float
    prefill_seconds: float


@dataclass(frozen=True)
class DecodeTimings:
    """D's part, before its first token: the RPC's arrival to the request admitted (lease check, block reservation,
    the KV pull and its checksums), then the admission to the first token out of D's engine."""

    handoff_seconds: float
    first_step_seconds: float
