"""`tandem bench serve` against a live prefill node, decode node and proxy: every request completes, with the
token counts the workload asked for (ignore_eos), on the completions and the chat endpoint."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

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


def _bench(url: str, model: Path, result_dir: Path, *flags: str) -> list[dict[str, object]]:
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
