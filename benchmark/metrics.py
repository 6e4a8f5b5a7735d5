"""The run's metrics, computed as vLLM's `bench serve` computes them, under its names.

Per completed request: TTFT; TPOT = (E2EL - TTFT) / (output tokens - 1), for requests of more than one output
token (goodput counts a one-token request's TPOT as 0); every inter-token latency; E2EL. Statistics are over
completed requests only; failed ones are counted, with their errors, and add no tokens. Times in the summary are
milliseconds; percentiles are numpy's (linear interpolation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from benchmark.client import RequestOutput

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class Distribution:
    """Summary of one latency metric, in milliseconds; `percentiles` is (percentile, value) in the order asked."""

    mean: float
    median: float
    std: float
    percentiles: tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    errors: tuple[str, ...]  # one per failed request
    total_input: int
    total_output: int
    duration: float  # seconds
    request_throughput: float
    request_goodput: float | None  # None without --goodput
    input_throughput: float
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    distributions: dict[str, Distribution]  # METRIC_NAMES -> summary


def parse_goodput(pairs: Sequence[str]) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` -> {"ttft": 200.0, "tpot": 50.0} (milliseconds), validated."""
    slos: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        try:
            slos[name] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"--goodput takes NAME:MILLISECONDS pairs, e.g. ttft:200 tpot:50 (got {pair!r})")
        if name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput metric {name!r} is not one of {', '.join(GOODPUT_METRICS)}")
        if slos[name] < 0:
            raise ValueError(f"--goodput {name} must not be negative")
    return slos


def distribution(values_s: Sequence[float], percentiles: Sequence[float]) -> Distribution:
    """Mean, median, std and percentiles of `values_s` (seconds) in milliseconds; all 0 for no values."""
    values = np.asarray(values_s, dtype=np.float64) * 1000 if len(values_s) else np.zeros(1)
    return Distribution(float(values.mean()), float(np.median(values)), float(values.std()),
                        tuple((p, float(np.percentile(values, p))) for p in percentiles))


def tpot(output: RequestOutput) -> float:
    """Seconds per output token after the first; 0 for a request of at most one token."""
    if output.output_tokens <= 1:
        return 0.0
    return (output.latency - output.ttft) / (output.output_tokens - 1)


def calculate_metrics(outputs: Sequence[RequestOutput], duration: float, percentiles: Sequence[float],
                      goodput_slos_ms: dict[str, float] | None = None) -> BenchmarkMetrics:
    assert duration > 0, f"a run's duration must be positive, got {duration}"
    done = [o for o in outputs if o.success]
    total_input = sum(o.prompt_len for o in done)
    total_output = sum(o.output_tokens for o in done)
    values = {
        "ttft": [o.ttft for o in done],
        "tpot": [tpot(o) for o in done if o.output_tokens > 1],
        "itl": [gap for o in done for gap in o.itl],
        "e2el": [o.latency for o in done],
    }
    goodput = None
    if goodput_slos_ms:
        per_request = {"ttft": lambda o: o.ttft, "tpot": tpot, "e2el": lambda o: o.latency}
        good = sum(all(per_request[name](o) * 1000 <= slo for name, slo in goodput_slos_ms.items()) for o in done)
        goodput = good / duration
    peak_tokens, peak_concurrency = _peaks(done)
    return BenchmarkMetrics(
        completed=len(done),
        failed=len(outputs) - len(done),
        errors=tuple(o.error for o in outputs if not o.success),
        total_input=total_input,
        total_output=total_output,
        duration=duration,
        request_throughput=len(done) / duration,
        request_goodput=goodput,
        input_throughput=total_input / duration,
        output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration,
        max_output_tokens_per_s=peak_tokens,
        max_concurrent_requests=peak_concurrency,
        distributions={name: distribution(values[name], percentiles) for name in METRIC_NAMES},
    )


def _peaks(done: Sequence[RequestOutput]) -> tuple[float, int]:
    """The most text chunks received in one whole second of the run, and the most requests in flight at once."""
    if not done:
        return 0.0, 0
    start = min(o.start_time for o in done)
    seconds: dict[int, int] = {}
    for o in done:
        t = o.start_time + o.ttft
        for gap in [0.0, *o.itl]:
            t += gap
            seconds[int(t - start)] = seconds.get(int(t - start), 0) + 1
    # ends sort before starts at the same instant: intervals are half-open
    events = sorted([(o.start_time, 1) for o in done] + [(o.start_time + o.latency, -1) for o in done])
    in_flight = peak = 0
    for _, delta in events:
        in_flight += delta
        peak = max(peak, in_flight)
    return float(max(seconds.values())), peak
