"""A read given up on (its timeout passed, or its peer was removed) is FAILED only once nothing more can land in its
local blocks: a decode node frees them on FAILED, and the next request's KV goes there.

Neither library can stop a read in flight: NIXL's release of a READ (and removing its peer) orphans UCX's GET,
whose bytes keep arriving; a running Mooncake batch read runs to its end. Before the connector waited for that,
this test saw all 8 blocks of a timed-out NIXL read written after FAILED, into blocks the test had filled since
(the slow-link partition scenario's wrong answers: another request's KV overwritten). Here a reader on one host
reads 128 KiB from an owner on another over a link slowed to 100 kbit/s, gives the read up, sees it PENDING while
its bytes still arrive, unslows the link, and once the read is FAILED fills its blocks with a sentinel: no byte
may change after that."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.multihost.hosts import Hosts, host_environment

pytestmark = [pytest.mark.multihost, pytest.mark.integration]
ROOT = Path(__file__).resolve().parents[2]
SIDE = [sys.executable, "-m", "tests.multihost.late_write_side"]


def _wait_for(folder: Path, name: str, processes: list, timeout: float = 60.0) -> None:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout
    while not (folder / name).exists():
        for process in processes:
            if process.poll() is not None:
                logs = "\n".join(p.read_text()[-2000:] for p in folder.glob("*.log"))
                raise RuntimeError(f"a side exited (rc {process.returncode}) before {name}:\n{logs}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {name} in {timeout} s")
        time.sleep(0.02)


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
@pytest.mark.parametrize("give_up", ["timeout", "remove"])
def test_a_read_given_up_fails_only_once_nothing_more_lands(backend: str, give_up: str, tmp_path: Path) -> None:
    with Hosts(2) as hosts:
        owner_host, reader_host = hosts
        processes = [
            owner_host.run([*SIDE, "owner", str(tmp_path), backend, owner_host.device, owner_host.ip],
                           env=host_environment(), log_path=tmp_path / "owner.log", cwd=ROOT),
            reader_host.run([*SIDE, "reader", str(tmp_path), backend, reader_host.device, reader_host.ip, give_up],
                            env=host_environment(), log_path=tmp_path / "reader.log", cwd=ROOT)]
        _wait_for(tmp_path, "shape", processes)
        owner_host.shape("100kbit")
        (tmp_path / "shaped").touch()
        _wait_for(tmp_path, "unshape", processes)
        owner_host.unshape()
        _wait_for(tmp_path, "result", processes)
        (tmp_path / "stop").touch()
        result = json.loads((tmp_path / "result").read_text())
    assert result["overwritten"] == [], f"bytes landed after FAILED in blocks {result['overwritten']}: {result}"
    assert result["statuses_before_unshape"] == ["PENDING"], result  # given up, still landing: not FAILED yet
    assert result["status"] == "FAILED", result
    expected = "timed out after 0.5 s" if give_up == "timeout" else "the peer was removed"
    assert result["reason"] == expected, result
    if give_up == "remove":
        assert result["peers"] == [], result
