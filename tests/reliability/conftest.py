"""The fault suite's shared cluster and its report (bench/results/reliability-<date>.md, written at the end)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy_cached
from tests.reliability.harness import Cluster, Row, started_cluster, write_report


@pytest.fixture(scope="session")
def report_rows() -> Iterator[list[Row]]:
    """The scenarios append their rows; the day's report gets them once the session ends."""
    rows: list[Row] = []
    yield rows
    if rows:
        write_report(rows)


@pytest.fixture(scope="session")
def cluster(tiny_model: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with started_cluster(tiny_model("llama"), tmp_path_factory.mktemp("reliability-logs"),
                         hf_greedy_cached) as running:
        yield running
