"""The result file carries vLLM's keys; compare lines result files up side by side."""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmark.client import RequestOutput
from benchmark.metrics import calculate_metrics
from benchmark.results import RunInfo, build_result, compare_table, load_result, result_filename, save_result

# the keys vLLM's `bench serve` writes (without --save-detailed) that tools read
VLLM_KEYS = {"date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
             "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
             "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
             "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests", "mean_ttft_ms",
             "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "std_tpot_ms",
             "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "std_itl_ms", "p99_itl_ms", "latencies"}


def _result(label: str, rate: float) -> dict[str, object]:
    outputs = [RequestOutput(prompt_len=4, output_tokens=3, ttft=0.1, itl=[0.01, 0.01], latency=0.12,
                             success=True), RequestOutput(error="boom")]
    info = RunInfo(backend="openai", label=label, model_id="/models/tiny", tokenizer_id=None, num_prompts=2,
                   request_rate=rate, max_concurrency=4, dataset_name="random", endpoint="/v1/completions")
    metrics = calculate_metrics(outputs, 1.0, [90, 99, 99.9])
    return build_result(info, metrics, outputs, ["ttft", "tpot", "itl", "e2el"], detailed=False)


def test_result_has_vllms_keys_and_keeps_errors(tmp_path: Path) -> None:
    result = _result("a", math.inf)
    assert VLLM_KEYS <= set(result)
    assert result["request_rate"] == "inf" and result["p99.9_e2el_ms"] == result["p90_e2el_ms"]
    assert result["errors"] == ["", "boom"] and "ttfts" not in result
    save_result(result, tmp_path / "r.json")
    assert load_result(tmp_path / "r.json") == json.loads(json.dumps(result))


def test_default_file_name_follows_vllms_pattern() -> None:
    info = RunInfo("openai", None, "/models/tiny", None, 2, 2.0, 4, "random", "/v1/completions")
    assert result_filename(info, "20261202-120000") == "openai-2qps-concurrency4-tiny-20261202-120000.json"


def test_compare_puts_each_file_in_a_column() -> None:
    text = compare_table([("tandem", _result("tandem", 1.0)), ("vllm", _result("vllm", 1.0))])
    header, *rows = text.splitlines()
    assert header.split() == ["metric", "tandem", "vllm"]
    completed = next(r for r in rows if r.startswith("completed"))
    assert completed.split() == ["completed", "1", "1"]
    assert any(r.startswith("p99.9_ttft_ms") for r in rows)
    markdown = compare_table([("tandem", _result("tandem", 1.0))], markdown=True)
    assert markdown.splitlines()[0] == "| metric | tandem |"
