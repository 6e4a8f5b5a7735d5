"""`tandem serve` as a child process for the bench drivers that measure the product as a user starts it
(bench/sim_validate.py, bench/planner_live.py): started in its own session, ready once it says so, stopped with
Ctrl-C's signal (so it drains and stops its nodes) and killed only if that does not end it in a minute."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TANDEM = [sys.executable, "-m", "cluster.cli"]


def start_serve(args: list[str], log: Path, timeout_s: float = 300.0) -> subprocess.Popen[bytes]:
    """`tandem serve ARGS`, its output in `log`; returns once it serves (RuntimeError with the log's tail if not)."""
    proc = subprocess.Popen([*TANDEM, "serve", *args], cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while "Tandem is serving" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_serve(proc)
            raise RuntimeError(f"tandem serve {' '.join(args)} did not start:\n{log.read_text()[-3000:]}")
        time.sleep(1)
    return proc


def stop_serve(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
