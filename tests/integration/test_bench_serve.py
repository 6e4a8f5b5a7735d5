"""`tandem bench serve` against a live prefill node, decode node and proxy: every request completes, with the
token counts the workload asked for (ignore_eos), on the completions and the chat endpoint."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster.cli import main
from tests.fixtures.tiny_models import TinyModelFactory
from tests.integration.processes import pd_cluster

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def proxy_url(tiny_model: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    model = tiny_model("llama")
    with pd_cluster(model, "nixl", tmp_path_factory.mktemp("bench-logs")) as url:
        yield url, model


def _bench(url: str, model: Path, result_dir: Path, *flags: str) -> list[dict[str, Any]]:
    # no --model: the benchmark asks the server's /v1/models, as vLLM's does
    code = main(["bench", "serve", "--base-url", url, "--tokenizer", str(model), "--seed", "1", "--disable-tqdm",
                 "--save-result", "--result-dir", str(result_dir), "--result-filename", "run.json", *flags])
    assert code == 0
    return [json.loads(p.read_text()) for p in sorted(result_dir.glob("run*.json"))]


def test_random_completions_sweep_completes_with_exact_token_counts(proxy_url: tuple[str, Path], tmp_path: Path
                                                                     ) -> None:
    url, model = proxy_url
    results = _bench(url, model, tmp_path, "--dataset-name", "random", "--random-input-len", "12",
                     "--random-output-len", "6", "--num-prompts", "6", "--max-concurrency", "2,4",
                     "--request-rate", "inf", "--goodput", "ttft:60000", "--sweep-fresh-prompts")
    assert len(results) == 2  # one file per concurrency of the sweep
    for result in results:
        assert (result["completed"], result["failed"]) == (6, 0), result["errors"]
        assert result["total_input_tokens"] == 6 * 12  # the tiny tokenizer adds no BOS: prompts are exact
        assert result["total_output_tokens"] == 6 * 6
        assert result["request_goodput"] == pytest.approx(result["request_throughput"])
        assert float(result["mean_ttft_ms"]) > 0 and float(result["mean_itl_ms"]) > 0  # type: ignore[arg-type]
    assert sorted(r["max_concurrency"] for r in results) == [2, 4]


def test_multi_turn_chat_completes(proxy_url: tuple[str, Path], tmp_path: Path) -> None:
    url, model = proxy_url
    (result,) = _bench(url, model, tmp_path, "--endpoint", "/v1/chat/completions", "--dataset-name", "multi-turn",
                       "--multi-turn-num-turns", "2", "--random-input-len", "8", "--random-output-len", "4",
                       "--num-prompts", "4", "--max-concurrency", "2", "--request-rate", "50")
    assert (result["completed"], result["failed"]) == (4, 0), result["errors"]
    assert result["total_output_tokens"] == 4 * 4
    assert result["endpoint"] == "/v1/chat/completions"


def test_multi_turn_sessions_send_the_servers_replies_back_and_report_its_cache_hits(
        proxy_url: tuple[str, Path], tmp_path: Path) -> None:
    url, model = proxy_url
    (result,) = _bench(url, model, tmp_path, "--dataset-name", "multi-turn-session", "--multi-turn-num-turns", "3",
                       "--multi-turn-system-prompt-len", "16", "--random-input-len", "8", "--random-output-len", "4",
                       "--num-prompts", "6", "--max-concurrency", "2", "--save-detailed")
    assert (result["completed"], result["failed"]) == (6, 0), result["errors"]
    assert result["endpoint"] == "/v1/chat/completions"  # the dataset's default endpoint
    assert result["total_output_tokens"] == 6 * 4
    assert result["session_turns"] == [1, 2, 3, 1, 2, 3]
    assert len(result["median_ttft_ms_by_turn"]) == 3
    assert result["total_prompt_tokens"] == sum(result["input_lens"])
    # a later turn's prompt starts with the turn before's: the prefill node's prefix cache hits it
    assert all(cached > 0 for cached, turn in zip(result["cached_tokens"], result["session_turns"], strict=True)
               if turn > 1), result["cached_tokens"]
    assert result["total_computed_prompt_tokens"] == result["total_prompt_tokens"] - result["total_cached_tokens"]
