"""The proxy's /metrics (proxy/api/metrics.py) as the planner reads them: one scrape's counters, gauges and
histogram buckets (prometheus_client's text parser), and the LoadWindow between two scrapes (counter and bucket
deltas; percentiles interpolated within buckets as Prometheus' histogram_quantile does)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from cluster.planner.types import LoadWindow

TTFT = "tandem:time_to_first_token_seconds"
ITL = "tandem:inter_token_latency_seconds"
COUNTERS = {"success": "tandem:request_success_total", "errors": "tandem:request_errors_total",
            "prompt_tokens": "tandem:prompt_tokens_total", "generation_tokens": "tandem:generation_tokens_total"}
RUNNING = "tandem:num_requests_running"
QUEUED_PREFILL = "tandem:num_queued_prefill_tokens"


@dataclass(frozen=True)
class Scrape:
    """One proxy's metrics at one instant (summed over their labels)."""

    counters: Mapping[str, float]  # COUNTERS' keys
    running: float
    queued_prefill_tokens: float  # on prefill nodes
    buckets: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)  # name -> (le, count)


def parse_scrape(text: str) -> Scrape:
    counters = dict.fromkeys(COUNTERS, 0.0)
    by_sample = {v: k for k, v in COUNTERS.items()}
    running = queued = 0.0
    buckets: dict[str, dict[float, float]] = {TTFT: {}, ITL: {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in by_sample:
                counters[by_sample[sample.name]] += sample.value
            elif sample.name == RUNNING:
                running += sample.value
            elif sample.name == QUEUED_PREFILL and sample.labels.get("role") == "prefill":
                queued += sample.value
            elif sample.name.endswith("_bucket") and sample.name[:-len("_bucket")] in buckets:
                le = float(sample.labels["le"])
                histogram = buckets[sample.name[:-len("_bucket")]]
                histogram[le] = histogram.get(le, 0.0) + sample.value
    return Scrape(counters, running, queued, {name: tuple(sorted(h.items())) for name, h in buckets.items()})


def merge(scrapes: Iterable[Scrape]) -> Scrape:
    """Several proxies' scrapes as one (their counters, gauges and buckets summed)."""
    scrapes = list(scrapes)
    counters = {k: sum(s.counters.get(k, 0.0) for s in scrapes) for k in COUNTERS}
    buckets: dict[str, dict[float, float]] = {}
    for s in scrapes:
        for name, pairs in s.buckets.items():
            for le, count in pairs:
                buckets.setdefault(name, {})[le] = buckets.setdefault(name, {}).get(le, 0.0) + count
    return Scrape(counters, sum(s.running for s in scrapes), sum(s.queued_prefill_tokens for s in scrapes),
                  {name: tuple(sorted(h.items())) for name, h in buckets.items()})


def quantile(buckets: Iterable[tuple[float, float]], percentile: float) -> float | None:
    """The percentile of a cumulative histogram ((le, count), +Inf last), as histogram_quantile: linear within
    the bucket it falls in; the highest finite bound when it falls in +Inf; None with no observations."""
    pairs = sorted(buckets)
    if not pairs or pairs[-1][1] <= 0:
        return None
    rank = percentile / 100 * pairs[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for le, count in pairs:
        if count >= rank:
            if math.isinf(le):
                return lower_bound
            if count == lower_count:
                return le
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = le, count
    return lower_bound


def _delta(new: float, old: float) -> float:
    """A counter's increase; a reset (the proxy restarted) counts from 0."""
    return new - old if new >= old else new


def bucket_delta(new: Iterable[tuple[float, float]], old: Iterable[tuple[float, float]]
                 ) -> tuple[tuple[float, float], ...]:
    before = dict(old)
    pairs = [(le, _delta(count, before.get(le, 0.0))) for le, count in new]
    # a reset in one bucket only would break monotonicity: keep the cumulative counts non-decreasing
    out, highest = [], 0.0
    for le, count in sorted(pairs):
        highest = max(highest, count)
        out.append((le, highest))
    return tuple(out)


def load_window(old: Scrape, new: Scrape, start_s: float, duration_s: float, percentile: float) -> LoadWindow:
    d = {k: _delta(new.counters.get(k, 0.0), old.counters.get(k, 0.0)) for k in COUNTERS}
    completed = d["success"] + d["errors"]
    # a request arrived in the interval if it ended in it or is still running at its end, less those running at
    # its start (prompt tokens are counted on arrival)
    arrivals = max(0.0, completed + new.running - old.running)
    return LoadWindow(
        start_s=start_s, duration_s=duration_s, arrivals=round(arrivals), prompt_tokens=round(d["prompt_tokens"]),
        output_tokens=round(d["generation_tokens"]), completed=round(completed),
        ttft_s=quantile(bucket_delta(new.buckets.get(TTFT, ()), old.buckets.get(TTFT, ())), percentile),
        itl_s=quantile(bucket_delta(new.buckets.get(ITL, ()), old.buckets.get(ITL, ())), percentile),
        running=round(new.running), waiting_prefill_tokens=round(new.queued_prefill_tokens))
