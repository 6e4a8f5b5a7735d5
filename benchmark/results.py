"""The result file (vLLM's `bench serve` keys, so tooling written for vLLM's files reads ours), the printed
report, and `compare` (several result files side by side)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmark.client import RequestOutput
from benchmark.metrics import BenchmarkMetrics

# Per-request lists that vLLM writes only with --save-detailed (they grow with the run).
DETAILED_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "cached_tokens",
                 "session_turns")
_HEADERS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
            "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


@dataclass(frozen=True)
class RunInfo:
    """The run's setup, as vLLM's result file records it."""

    backend: str
    label: str | None
    model_id: str
    tokenizer_id: str | None
    num_prompts: int
    request_rate: float
    max_concurrency: int | None
    dataset_name: str
    endpoint: str
    burstiness: float = 1.0


def percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def build_result(info: RunInfo, metrics: BenchmarkMetrics, outputs: Sequence[RequestOutput],
                 percentile_metrics: Sequence[str], detailed: bool) -> dict[str, Any]:
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": info.backend,
        "backend": info.backend,
        "label": info.label,
        "model_id": info.model_id,
        "tokenizer_id": info.tokenizer_id,
        "num_prompts": info.num_prompts,
        "request_rate": "inf" if math.isinf(info.request_rate) else info.request_rate,
        "burstiness": info.burstiness,
        "max_concurrency": info.max_concurrency,
        "dataset_name": info.dataset_name,
        "endpoint": info.endpoint,
        "duration": metrics.duration,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput,
        "input_throughput": metrics.input_throughput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
        # unlike vLLM, always kept: a failure is never dropped silently ("" for a request that completed)
        "errors": [o.error for o in outputs],
        "latencies": [o.latency for o in outputs],  # vLLM keeps these without --save-detailed too
        # the prompt cache, from the server's usage (None where it reported none): computed = prompt - cached
        "total_prompt_tokens": metrics.total_prompt_tokens,
        "total_cached_tokens": metrics.total_cached_tokens,
        "total_computed_prompt_tokens": metrics.total_computed_prompt_tokens,
    }
    if metrics.median_ttft_ms_by_turn:  # multi-turn-session: does a later turn find its history in the cache?
        result["median_ttft_ms_by_turn"] = list(metrics.median_ttft_ms_by_turn)  # turn 1 first
        result["median_ttft_first_turn_ms"] = metrics.median_ttft_ms_by_turn[0]
        result["median_ttft_later_turns_ms"] = metrics.median_ttft_ms_later_turns
    if detailed:
        result.update({
            "input_lens": [o.prompt_len for o in outputs],
            "output_lens": [o.output_tokens if o.success else 0 for o in outputs],
            "ttfts": [o.ttft for o in outputs],
            "itls": [o.itl for o in outputs],
            "start_times": [o.start_time for o in outputs],
            "generated_texts": [o.generated_text for o in outputs],
            "cached_tokens": [o.usage.cached_tokens if o.usage else None for o in outputs],
        })
        if metrics.median_ttft_ms_by_turn:
            result["session_turns"] = [o.session_turn for o in outputs]
    for name in percentile_metrics:
        summary = metrics.distributions[name]
        result[f"mean_{name}_ms"] = summary.mean
        result[f"median_{name}_ms"] = summary.median
        result[f"std_{name}_ms"] = summary.std
        for p, value in summary.percentiles:
            result[f"p{percentile_word(p)}_{name}_ms"] = value
    return result


def format_report(result: dict[str, Any], metrics: BenchmarkMetrics, percentile_metrics: Sequence[str]) -> str:
    """The report vLLM prints, line for line where the metric is the same."""
    lines = ["{:=^50}".format(" Serving Benchmark Result ")]

    def row(label: str, value: Any) -> None:
        lines.append(f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value:<10}")

    row("Successful requests:", metrics.completed)
    row("Failed requests:", metrics.failed)
    if result["max_concurrency"] is not None:
        row("Maximum request concurrency:", result["max_concurrency"])
    if result["request_rate"] != "inf":
        row("Request rate configured (RPS):", float(result["request_rate"]))
    row("Benchmark duration (s):", metrics.duration)
    row("Total input tokens:", metrics.total_input)
    row("Total generated tokens:", metrics.total_output)
    row("Request throughput (req/s):", metrics.request_throughput)
    if metrics.request_goodput is not None:
        row("Request goodput (req/s):", metrics.request_goodput)
    row("Input token throughput (tok/s):", metrics.input_throughput)
    row("Output token throughput (tok/s):", metrics.output_throughput)
    row("Peak output token throughput (tok/s):", metrics.max_output_tokens_per_s)
    row("Peak concurrent requests:", metrics.max_concurrent_requests)
    row("Total token throughput (tok/s):", metrics.total_token_throughput)
    if metrics.total_prompt_tokens is not None:
        lines.append("{:-^50}".format(" Prompt Cache (server usage) "))
        row("Prompt tokens:", metrics.total_prompt_tokens)
        row("Cached prompt tokens:", _or_dash(metrics.total_cached_tokens))
        row("Computed prompt tokens:", _or_dash(metrics.total_computed_prompt_tokens))
    if metrics.median_ttft_ms_by_turn:
        lines.append("{:-^50}".format(" TTFT by Session Turn "))
        for number, median in enumerate(metrics.median_ttft_ms_by_turn, 1):
            row(f"Median TTFT turn {number} (ms):", _or_dash(median))
        row("Median TTFT turns 2+ (ms):", _or_dash(metrics.median_ttft_ms_later_turns))
    for name in percentile_metrics:
        summary, label = metrics.distributions[name], name.upper()
        lines.append(f"{_HEADERS[name]:-^50}")
        row(f"Mean {label} (ms):", summary.mean)
        row(f"Median {label} (ms):", summary.median)
        for p, value in summary.percentiles:
            row(f"P{percentile_word(p)} {label} (ms):", value)
    if metrics.errors:
        lines.append("{:-^50}".format(" Errors (first 10) "))
        lines += [f"  {error}" for error in metrics.errors[:10]]
    lines.append("=" * 50)
    return "\n".join(lines)


def _or_dash(value: float | None) -> float | int | str:
    return "-" if value is None else value


def result_filename(info: RunInfo, date: str) -> str:
    """vLLM's default name: {label or backend}-{rate}qps[-concurrency{N}]-{model}-{date}.json."""
    rate = "inf" if math.isinf(info.request_rate) else f"{info.request_rate:g}"
    concurrency = f"-concurrency{info.max_concurrency}" if info.max_concurrency is not None else ""
    return f"{info.label or info.backend}-{rate}qps{concurrency}-{Path(info.model_id).name}-{date}.json"


def save_result(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def load_result(path: Path) -> dict[str, Any]:
    try:
        body = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read result file {path}: {e}") from None
    if not isinstance(body, dict) or "completed" not in body:
        raise ValueError(f"{path} is not a `bench serve` result file (no 'completed' key)")
    return body


COMPARE_ROWS = (
    ("completed", "completed"), ("failed", "failed"), ("request_rate", "request rate (req/s)"),
    ("max_concurrency", "max concurrency"), ("duration", "duration (s)"),
    ("request_throughput", "request throughput (req/s)"), ("request_goodput", "goodput (req/s)"),
    ("output_throughput", "output tok/s"), ("total_token_throughput", "total tok/s"),
    ("total_prompt_tokens", "prompt tokens"), ("total_cached_tokens", "cached prompt tokens"),
    ("total_computed_prompt_tokens", "computed prompt tokens"),
)


def compare_table(results: Sequence[tuple[str, dict[str, Any]]], markdown: bool = False) -> str:
    """One column per result file; the rows every file shares, latency rows for each metric and statistic
    present in any file (blank where a file lacks it)."""
    latency_keys = []
    for _, result in results:
        for key in result:
            if key.endswith("_ms") and not key.startswith("std_") and key not in latency_keys:
                latency_keys.append(key)
    rows = [(key, label) for key, label in COMPARE_ROWS] + [(key, key) for key in latency_keys]
    names = [name for name, _ in results]
    table = [["metric", *names]]
    for key, label in rows:
        cells = [_cell(result.get(key)) for _, result in results]
        if any(cells):
            table.append([label, *cells])
    if markdown:
        lines = ["| " + " | ".join(table[0]) + " |", "|" + "---|" * len(table[0])]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in table[1:]])
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in table)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)
