"""Multi-host tests: network namespaces on one box (tests/multihost/hosts.py). They need root and iproute2 and skip,
saying why, without them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.multihost.hosts import Hosts, skip_reason


@pytest.fixture(scope="session")
def multihost_skip_reason() -> str | None:
    return skip_reason()


@pytest.fixture(autouse=True)
def _needs_namespaces(multihost_skip_reason: str | None) -> None:
    if multihost_skip_reason is not None:
        pytest.skip(multihost_skip_reason)


@pytest.fixture
def two_hosts() -> Iterator[Hosts]:
    with Hosts(2) as hosts:
        yield hosts
