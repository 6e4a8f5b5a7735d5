"""Plots: per-request TPOT from a detailed result, and PNGs written for a sweep and for distributions."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmark.plots import plot_distributions, plot_sweep, request_tpots_ms


def _result(label: str, throughput: float) -> dict[str, object]:
    return {"label": label, "output_throughput": throughput, "median_ttft_ms": 10.0, "p99_ttft_ms": 20.0,
            "median_tpot_ms": 5.0, "p99_tpot_ms": 7.0, "ttfts": [0.1, 0.2, 0.0], "latencies": [0.5, 0.2, 0.0],
            "output_lens": [5, 1, 0], "errors": ["", "", "boom"]}


def test_request_tpots_skip_single_token_requests() -> None:
    # (0.5 - 0.1) / (5 - 1) = 100 ms; the one-token and the failed (0-token) request have none
    assert request_tpots_ms(_result("a", 1.0)) == pytest.approx([100.0])


def test_sweep_and_distribution_plots_are_pngs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    runs = [("a1", _result("a", 1.0)), ("a2", _result("a", 2.0)), ("b1", _result("b", 1.5))]
    for path in (plot_sweep(runs, tmp_path / "sweep.png"), plot_distributions(runs, tmp_path / "dist.png")):
        assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_distributions([("x", {"completed": 1})], tmp_path / "none.png") is None
