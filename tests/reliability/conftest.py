"""The fault suite's shared cluster and its report (with --reliability-report PATH, written at the end)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy_cached
from tests.reliability.harness import Cluster, Row, started_cluster, write_report


@pytest.fixture(scope="session")
def report_rows(request: pytest.FixtureRequest) -> Iterator[list[Row]]:
    """The scenarios append their rows; the report named by --reliability-report gets them once the session ends."""
    rows: list[Row] = []
    yield rows
    path = request.config.getoption("--reliability-report")
    if rows and path:
        write_report(rows, Path(path))


@pytest.fixture(scope="session")
def cluster(tiny_model: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with started_cluster(tiny_model("llama"), tmp_path_factory.mktemp("reliability-logs"),
                         hf_greedy_cached) as running:
        yield running
