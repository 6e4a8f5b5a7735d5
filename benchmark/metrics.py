"""The run's metrics, computed as vLLM's `bench serve` computes them, under its names.

Per completed request: TTFT; TPOT = (E2EL - TTFT) / (output tokens - 1), for requests of more than one output
token (goodput counts a one-token request's TPOT as 0); every inter-token latency; E2EL. Statistics are over
completed requests only; failed ones are counted, with their errors, and add no tokens. Times in the summary are
milliseconds; percentiles are numpy's (linear interpolation).

The prompt cache: the server's `usage.prompt_tokens` and `usage.prompt_tokens_details.cached_tokens`, summed over
every request that reported them (failed ones included: their prefill happened), so prompt tokens computed =
prompt tokens - cached tokens. A multi-turn-session run also gets each turn number's median TTFT.
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
    total_prompt_tokens: int | None = None  # sum of usage.prompt_tokens; None when no request reported usage
    total_cached_tokens: int | None = None  # sum of usage.prompt_tokens_details.cached_tokens; None: not reported
    # multi-turn-session: median TTFT (ms) of the completed turns numbered 1, 2, ... (empty for other datasets);
    # `None` for a turn number no completed request had
    median_ttft_ms_by_turn: tuple[float | None, ...] = ()
    median_ttft_ms_later_turns: float | None = None  # the completed turns after each session's first, pooled

    @property
    def total_computed_prompt_tokens(self) -> int | None:
        """Prompt tokens the server prefilled rather than found in its cache."""
        if self.total_prompt_tokens is None or self.total_cached_tokens is None:
            return None
        return self.total_prompt_tokens - self.total_cached_tokens


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
    usages = [o.usage for o in outputs if o.usage is not None]
    cached = [u.cached_tokens for u in usages if u.cached_tokens is not None]
    by_turn, later_turns = _ttft_by_turn(done)
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
        total_prompt_tokens=sum(u.prompt_tokens for u in usages) if usages else None,
        total_cached_tokens=sum(cached) if cached else None,
        median_ttft_ms_by_turn=by_turn,
        median_ttft_ms_later_turns=later_turns,
    )


def _ttft_by_turn(done: Sequence[RequestOutput]) -> tuple[tuple[float | None, ...], float | None]:
    """Median TTFT (ms) per session turn number, and over every turn after the first; nothing outside sessions."""
    ttfts: dict[int, list[float]] = {}
    for o in done:
        if o.session_turn is not None:
            ttfts.setdefault(o.session_turn, []).append(o.ttft * 1000)
    if not ttfts:
        return (), None
    by_turn = tuple(float(np.median(ttfts[n])) if n in ttfts else None for n in range(1, max(ttfts) + 1))
    later = [t for n, values in ttfts.items() if n > 1 for t in values]
    return by_turn, float(np.median(later)) if later else None


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
