"""Fixtures of the engine's unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def async_scheduling(request: pytest.FixtureRequest) -> bool:
    """Both engine step modes (EngineConfig.async_scheduling): on CPU the asynchronous one runs the same
    bookkeeping (outputs a step late, pending tokens fed from the last step's sampled tensor) synchronously."""
    return bool(request.param)
