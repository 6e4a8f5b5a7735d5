"""Fixtures the integration modules share."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from tests.fixtures.tiny_models import TinyModelFactory

if TYPE_CHECKING:  # openai_cluster imports the openai SDK, which the GPU machine lacks (its GPU tests need none)
    from tests.integration.openai_cluster import Cluster


@pytest.fixture(scope="session")
def agentic_cluster(tiny_model: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One cluster for the tool-calling, client and Responses modules (a start costs ~15 s each): a tiny llama
    with a context and KV cache that hold the tools' descriptions (its template cannot render tools, so the proxy
    describes them in a long system message), an open proxy that disaggregates every request and a guarded one
    that colocates short prompts."""
    from tests.integration.openai_cluster import running_cluster

    model = tiny_model("llama", max_position_embeddings=1024)
    log_dir = tmp_path_factory.mktemp("agentic-logs")
    with running_cluster(model, log_dir, node_args=["--num-kv-blocks", "512"]) as cluster:
        yield cluster
