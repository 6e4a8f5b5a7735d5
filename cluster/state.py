"""Where Tandem keeps its files, and the local cluster's state file: how the CLI finds the admin API.

`tandem serve` writes `<cache dir>/cluster.json` (mode 0600: it holds the admin token) and removes it on exit;
`tandem status` and `tandem scale` read it when no --admin-url is given.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from settings import env as environment


def cache_dir() -> Path:
    """$TANDEM_CACHE_DIR, else $XDG_CACHE_HOME/tandem, else ~/.cache/tandem."""
    return environment.cache_dir()


def state_path() -> Path:
    return cache_dir() / "cluster.json"


@dataclass(frozen=True)
class ClusterState:
    admin_url: str
    token: str
    proxy_url: str
    pid: int


def write_state(state: ClusterState, path: Path | None = None) -> Path:
    """Atomically, and readable by this user only (the file is created 0600, never widened)."""
    path = path or state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=".cluster-", suffix=".json", dir=path.parent)  # mkstemp: mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(state), f, indent=2)
            f.write("\n")
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
    return path


def read_state(path: Path | None = None) -> ClusterState | None:
    """The state file's content, or None when there is none (no local cluster)."""
    path = path or state_path()
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    return ClusterState(admin_url=raw["admin_url"], token=raw["token"], proxy_url=raw["proxy_url"],
                        pid=int(raw["pid"]))


def remove_state(pid: int, path: Path | None = None) -> None:
    """Removes the state file if it is still the one process `pid` wrote (a newer cluster may own it)."""
    path = path or state_path()
    current = read_state(path)
    if current is not None and current.pid == pid:
        path.unlink(missing_ok=True)
