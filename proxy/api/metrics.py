"""Prometheus metrics of the proxy and, polled on each scrape, of the nodes behind it (docs/operations.md#metrics).

Names are vLLM's under the `tandem:` prefix, each with a `model_name` label:

- per request, measured at the proxy: time_to_first_token_seconds, inter_token_latency_seconds,
  e2e_request_latency_seconds, request_success_total{finished_reason}, prompt_tokens_total,
  generation_tokens_total, num_requests_running (sub-requests in flight here), request_errors_total{code};
- where a disaggregated request's time goes, as its nodes report it (wire.timings, proxy.routing.phases):
  request_queue_time_seconds and request_prefill_time_seconds (vLLM's names: on P), kv_handoff_seconds (D: the
  Generate's arrival to the request admitted, its KV pulled and verified) and first_decode_step_seconds (D: the
  admission to its first token); inter_token_latency_seconds above goes on from there;
- routing: pd_decisions_total{mode}, read from the router's decision counts;
- failures handled: attempts_abandoned_total{role, reason} (attempts the proxy gave up on: reason node_lost or
  timeout, proxy.routing.attempts) and request_retries_total{role} (failed or abandoned attempts retried, by the role
  of the node that failed), read from the pipeline's counts; decode_migrations_total{outcome} (requests whose
  decode node was lost after streaming: migrated to another one, or not: no_decode_node, no_retry_left,
  past_deadline; proxy.routing.migration);
- per node (`node_id`, `role` labels), from the nodes' Stats on each scrape: kv_cache_usage_perc,
  num_requests_waiting, node_num_requests_running, prefix_cache_queries_total / _hits_total (tokens),
  prefill_leases_expired_total, kv_transfer_failures_total, spec_decode_num_drafts_total /
  _num_draft_tokens_total / _num_accepted_tokens_total (decode nodes), node_up (0 when Stats failed) and
  node_heartbeat_age_seconds (registered nodes), num_queued_prefill_tokens, node_info{kv_backend, pod_uid} (1);
  num_nodes{role}: how many nodes the proxy sees;
- per node and KV tier below its pool (`tier`: host, store; docs/architecture.md#kv-tiers): kv_tier_queries_total /
  kv_tier_hits_total (tokens, the prefix cache's shape), kv_tier_read_bytes_total / _write_bytes_total,
  kv_tier_usage_perc (host), kv_tier_errors_total (store).

Each app gets a private CollectorRegistry, so several apps (tests) can live in one process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily

from proxy.routing.attempts import AbandonReason, AttemptCounts
from proxy.routing.directory import NodeDirectory, NodeView
from proxy.routing.migration import MigrationOutcome
from wire import DecodeTimings, NodeCapacity, NodeLoad, NodeStats, PrefillTimings, Role

logger = logging.getLogger(__name__)

NODE_POLL_TIMEOUT_S = 1.0

# vLLM's buckets: TTFT from 1 ms to minutes, ITL from 10 ms (GPU decode) to seconds (CPU, queues).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
# A request's phases on the nodes: sub-millisecond (a GPU step, a KV pull over NVLink) to minutes (a queue).
PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)

# The *_created series double every counter's output for no use here (vLLM turns them off too).
prometheus_client.disable_created_metrics()


@dataclass(frozen=True)
class NodeSnapshot:
    """A node as one scrape saw it: its Stats when it answered, else the routing table's load and capacity."""

    node_id: str
    role: Role
    up: bool  # healthy and taking requests
    capacity: NodeCapacity
    load: NodeLoad
    stats: NodeStats | None = None  # None: not asked, or no answer (the node's counters are then unknown)
    heartbeat_at: float | None = None  # registered nodes: unix time of the record's last write (node's clock)
    kv_backend: str = ""
    pod_uid: str = ""


class RequestRecorder:
    """The metrics of one sub-request (one choice), from its arrival at the proxy to its end."""

    def __init__(self, metrics: ProxyMetrics, arrival: float, num_prompt_tokens: int) -> None:
        self.metrics = metrics
        self.arrival = arrival  # time.monotonic() when the HTTP request arrived
        self.last_token_time: float | None = None
        self.done = False
        metrics.running.inc()
        metrics.prompt_tokens.inc(num_prompt_tokens)

    def on_tokens(self, num_tokens: int) -> None:
        now = time.monotonic()
        if num_tokens == 0:
            return
        if self.last_token_time is None:
            self.metrics.time_to_first_token.observe(now - self.arrival)
            num_gaps = num_tokens - 1
        else:
            num_gaps = num_tokens
        if num_gaps:
            gap = (now - (self.last_token_time or now)) / num_gaps
            for _ in range(num_gaps):
                self.metrics.inter_token_latency.observe(gap)
        self.last_token_time = now
        self.metrics.generation_tokens.inc(num_tokens)

    def finish(self, finished_reason: str) -> None:
        if self.done:
            return
        self.done = True
        self.metrics.e2e_request_latency.observe(time.monotonic() - self.arrival)
        self.metrics.request_success.labels(self.metrics.model_name, finished_reason).inc()

    def fail(self, code: str) -> None:
        if self.done:
            return
        self.done = True
        self.metrics.request_errors.labels(self.metrics.model_name, code).inc()

    def close(self) -> None:
        """Ends the sub-request; one that neither finished nor failed was aborted (client gone)."""
        self.finish("abort")
        self.metrics.running.dec()


class PhaseHistograms:
    """The phases the nodes report for each disaggregated request (proxy.routing.phases.PhaseSink)."""

    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        def histogram(name: str, documentation: str) -> Histogram:
            return Histogram(name, documentation, ["model_name"], registry=registry,
                             buckets=PHASE_BUCKETS).labels(model_name)

        self.queue = histogram("tandem:request_queue_time_seconds", "Time on the prefill node from the Prefill's "
                               "arrival to the engine step that first scheduled it.")
        self.prefill = histogram("tandem:request_prefill_time_seconds", "Time on the prefill node from that step "
                                 "to the first token.")
        self.handoff = histogram("tandem:kv_handoff_seconds", "Time on the decode node from the Generate's arrival "
                                 "to the request admitted: lease check, blocks, KV pull and checksums.")
        self.first_step = histogram("tandem:first_decode_step_seconds", "Time on the decode node from the "
                                    "admission to its first token.")

    def observe_prefill(self, timings: PrefillTimings) -> None:
        self.queue.observe(timings.queue_seconds)
        self.prefill.observe(timings.prefill_seconds)

    def observe_decode(self, timings: DecodeTimings) -> None:
        self.handoff.observe(timings.handoff_seconds)
        self.first_step.observe(timings.first_step_seconds)


class ProxyMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry or CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.time_to_first_token = Histogram(
            "tandem:time_to_first_token_seconds", "Time from the request's arrival to its first token.", labels,
            registry=r, buckets=TTFT_BUCKETS).labels(model_name)
        self.inter_token_latency = Histogram(
            "tandem:inter_token_latency_seconds", "Time between consecutive tokens of a request.", labels,
            registry=r, buckets=ITL_BUCKETS).labels(model_name)
        self.e2e_request_latency = Histogram(
            "tandem:e2e_request_latency_seconds", "Time from the request's arrival to its end.", labels,
            registry=r, buckets=E2E_BUCKETS).labels(model_name)
        self.request_success = Counter(
            "tandem:request_success", "Requests (choices) that ended, by finish reason.",
            [*labels, "finished_reason"], registry=r)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name, reason)
        self.request_errors = Counter(
            "tandem:request_errors", "Requests (choices) that failed, by OpenAI error code.", [*labels, "code"],
            registry=r)
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prompt tokens sent to prefill.", labels,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("tandem:generation_tokens", "Tokens generated.", labels,
                                         registry=r).labels(model_name)
        self.running = Gauge("tandem:num_requests_running", "Requests (choices) in flight at the proxy.", labels,
                             registry=r).labels(model_name)
        self.phases = PhaseHistograms(model_name, r)
        self.cluster = ClusterCollector(model_name)
        r.register(self.cluster)

    def request(self, arrival: float, num_prompt_tokens: int) -> RequestRecorder:
        return RequestRecorder(self, arrival, num_prompt_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ClusterCollector:
    """The nodes' metrics from the latest snapshot, and the router's decision counts read at collect time."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.nodes: list[NodeSnapshot] = []
        self.decision_counts: Callable[[], Mapping[str, int] | None] = lambda: None
        self.attempt_counts: Callable[[], AttemptCounts | None] = lambda: None
        self.migration_counts: Callable[[], Mapping[str, int] | None] = lambda: None

    def collect(self) -> Iterator[Metric]:
        m = self.model_name
        decisions = CounterMetricFamily("tandem:pd_decisions", "Routing decisions, by mode "
                                        "(disaggregated: prefill on P; colocated: prefill on D).",
                                        labels=["model_name", "mode"])
        for mode, count in sorted((self.decision_counts() or {}).items()):
            decisions.add_metric([m, str(mode)], count)
        yield decisions
        yield from self._attempts()

        labels = ["model_name", "node_id", "role"]
        up = GaugeMetricFamily("tandem:node_up", "1 when the node answered the last Stats poll.", labels=labels)
        usage = GaugeMetricFamily("tandem:kv_cache_usage_perc", "Fraction of the node's KV blocks in use.",
                                  labels=labels)
        waiting = GaugeMetricFamily("tandem:num_requests_waiting", "Requests queued on the node.", labels=labels)
        running = GaugeMetricFamily("tandem:node_num_requests_running", "Requests running on the node.",
                                    labels=labels)
        queries = CounterMetricFamily("tandem:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      labels=labels)
        hits = CounterMetricFamily("tandem:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   labels=labels)
        expired = CounterMetricFamily("tandem:prefill_leases_expired", "KV tickets freed because their lease "
                                      "expired before a decode node released them.", labels=labels)
        failures = CounterMetricFamily("tandem:kv_transfer_failures", "KV transfers that failed or were corrupt.",
                                       labels=labels)
        transfer_bytes = CounterMetricFamily("tandem:kv_transfer_bytes", "KV bytes decode nodes pulled.",
                                             labels=labels)
        transfer_seconds = SummaryMetricFamily("tandem:kv_transfer_seconds", "KV pulls, from the READ to the "
                                               "verified checksums.", labels=labels)
        # per role, 0 included: "no decode node" must be a series with value 0, not a missing one, for alerts
        num_nodes = GaugeMetricFamily("tandem:num_nodes", "Nodes this proxy sees (registered or listed), by role.",
                                      labels=["model_name", "role"])
        for role in Role:
            num_nodes.add_metric([m, role.value], sum(1 for node in self.nodes if node.role is role))
        yield num_nodes
        heartbeat_age = GaugeMetricFamily("tandem:node_heartbeat_age_seconds", "Seconds since a registered node's "
                                          "record was last written (its heartbeat; the node's clock against this "
                                          "proxy's).", labels=labels)
        # an info metric (value 1): queries join it on node_id for the backend, e.g. transfer bytes by backend
        info = GaugeMetricFamily("tandem:node_info", "A node's KV backend and pod (1 per node).",
                                 labels=[*labels, "kv_backend", "pod_uid"])
        queued = GaugeMetricFamily("tandem:num_queued_prefill_tokens", "Prompt tokens admitted on the node but not "
                                   "computed yet.", labels=labels)
        now = time.time()
        # vLLM's speculative-decoding counters; the acceptance rate is accepted / draft tokens
        drafts = CounterMetricFamily("tandem:spec_decode_num_drafts", "Verification steps of a request with "
                                     "speculative drafts.", labels=labels)
        draft_tokens = CounterMetricFamily("tandem:spec_decode_num_draft_tokens", "Speculative draft tokens "
                                           "proposed.", labels=labels)
        accepted_tokens = CounterMetricFamily("tandem:spec_decode_num_accepted_tokens", "Speculative draft tokens "
                                              "the target model accepted.", labels=labels)
        tiers = _TierFamilies(labels)
        for node in self.nodes:
            values = [m, node.node_id, node.role.value]
            up.add_metric(values, 1 if node.up else 0)
            info.add_metric([*values, node.kv_backend, node.pod_uid], 1)
            if node.heartbeat_at is not None:
                heartbeat_age.add_metric(values, max(0.0, now - node.heartbeat_at))
            s = node.stats
            capacity, load = (s.capacity, s.load) if s is not None else (node.capacity, node.load)
            if capacity.total_kv_blocks:  # 0: not known yet
                usage.add_metric(values, 1 - load.free_kv_blocks / capacity.total_kv_blocks)
            waiting.add_metric(values, load.num_waiting)
            queued.add_metric(values, load.num_queued_prefill_tokens)
            running.add_metric(values, load.num_running)
            if s is None:
                continue
            queries.add_metric(values, s.prefix_cache_queries)
            hits.add_metric(values, s.prefix_cache_hits)
            tiers.add(values, s)
            if node.role is Role.PREFILL:
                expired.add_metric(values, s.num_leases_expired)
            else:
                failures.add_metric(values, s.num_transfer_failures)
                transfer_bytes.add_metric(values, s.kv_transfer_bytes)
                transfer_seconds.add_metric(values, count_value=s.kv_transfer_count,
                                            sum_value=s.kv_transfer_seconds_sum)
                drafts.add_metric(values, s.spec_decode_num_drafts)
                draft_tokens.add_metric(values, s.spec_decode_num_draft_tokens)
                accepted_tokens.add_metric(values, s.spec_decode_num_accepted_tokens)
        yield from (up, info, heartbeat_age, queued, usage, waiting, running, queries, hits, expired, failures,
                    transfer_bytes, transfer_seconds, drafts, draft_tokens, accepted_tokens)
        yield from tiers.families()


    def _attempts(self) -> Iterator[Metric]:
        m = self.model_name
        abandoned = CounterMetricFamily("tandem:attempts_abandoned", "Attempts (one RPC to one node) the proxy gave "
                                        "up on, by node role and reason (node_lost: failed health checks or "
                                        "unreachable; timeout: no progress).", labels=["model_name", "role", "reason"])
        retries = CounterMetricFamily("tandem:request_retries", "Failed or abandoned attempts retried, by the role "
                                      "of the node that failed.", labels=["model_name", "role"])
        migrations = CounterMetricFamily("tandem:decode_migrations", "Requests whose decode node was lost after it "
                                         "streamed tokens, by outcome (migrated: continued on another decode node).",
                                         labels=["model_name", "outcome"])
        counts = self.attempt_counts() or AttemptCounts()
        for role in Role:
            for reason in AbandonReason:
                abandoned.add_metric([m, role.value, reason.value], counts.abandoned[(role.value, reason.value)])
            retries.add_metric([m, role.value], counts.retries[role.value])
        migration_counts = self.migration_counts() or {}
        for outcome in MigrationOutcome:
            migrations.add_metric([m, outcome.value], migration_counts.get(outcome.value, 0))
        yield from (abandoned, retries, migrations)


# ---- what the nodes say ----

async def poll_nodes(directory: NodeDirectory, with_stats: bool = True) -> list[NodeSnapshot]:
    """Every node the directory knows (registered or static, healthy or not), with its Stats when
    `with_stats` and it answers within NODE_POLL_TIMEOUT_S."""

    async def poll(node: NodeView) -> NodeSnapshot:
        stats = await _ask_stats(directory, node) if with_stats else None
        return NodeSnapshot(node.node_id, node.role, node.healthy and not node.draining, node.capacity, node.load,
                            stats, node.updated_at if node.registered else None, node.kv_backend, node.pod_uid)

    return list(await asyncio.gather(*(poll(node) for node in directory.all_nodes())))


async def _ask_stats(directory: NodeDirectory, node: NodeView) -> NodeStats | None:
    """A node's Stats; None when it does not answer (a node down is a fact to report, not an error)."""
    try:
        return await asyncio.wait_for(directory.client(node).stats(timeout=NODE_POLL_TIMEOUT_S),
                                      NODE_POLL_TIMEOUT_S * 2)
    except Exception as e:  # noqa: BLE001 - any failure means "no answer"
        logger.debug("node %s did not answer Stats: %r", node.node_id, e)
        return None


class _TierFamilies:
    """The KV tiers below each node's pool (docs/architecture.md#kv-tiers), one series per node and tier: the
    prefix cache's queries and hits in the same shape as the pool's (tandem:prefix_cache_*), and the bytes
    that moved."""

    def __init__(self, labels: list[str]) -> None:
        labels = [*labels, "tier"]
        self.queries = CounterMetricFamily("tandem:kv_tier_queries", "Prompt tokens looked up in a KV tier below "
                                           "the pool (past the tiers above it).", labels=labels)
        self.hits = CounterMetricFamily("tandem:kv_tier_hits", "Prompt tokens found in a KV tier below the pool.",
                                        labels=labels)
        self.read_bytes = CounterMetricFamily("tandem:kv_tier_read_bytes", "KV bytes read from a tier (host: "
                                              "loaded into the pool; store: got).", labels=labels)
        self.write_bytes = CounterMetricFamily("tandem:kv_tier_write_bytes", "KV bytes written to a tier (host: "
                                               "spilled or imported; store: put).", labels=labels)
        self.usage = GaugeMetricFamily("tandem:kv_tier_usage_perc", "Fraction of a node's host tier in use.",
                                       labels=labels)
        self.errors = CounterMetricFamily("tandem:kv_tier_errors", "KV store calls that failed and store blocks "
                                          "that failed their checks (each a miss, recomputed).", labels=labels)

    def add(self, values: list[str], stats: NodeStats) -> None:
        for tier, counts in (("host", stats.host_tier), ("store", stats.store_tier)):
            if counts is None:
                continue
            labelled = [*values, tier]
            self.queries.add_metric(labelled, counts.queries)
            self.hits.add_metric(labelled, counts.hits)
            self.read_bytes.add_metric(labelled, counts.read_bytes)
            self.write_bytes.add_metric(labelled, counts.write_bytes)
            if counts.total_blocks:
                self.usage.add_metric(labelled, counts.used_blocks / counts.total_blocks)
            if tier == "store":
                self.errors.add_metric(labelled, counts.errors)

    def families(self) -> Iterator[Metric]:
        yield from (self.queries, self.hits, self.read_bytes, self.write_bytes, self.usage, self.errors)
