"""Node and proxy processes for bench/gpu_cluster.py: start on free loopback ports, wait until ready, stop by
process group (each child leads its own session, so a stop reaches exactly the processes this script started)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ProcessFailed(RuntimeError):
    """A child exited or never became ready; the message ends with the tail of its log."""


@dataclass
class Child:
    """A `python -m MODULE ...` child whose output goes to a log file."""

    name: str
    command: list[str]
    log_path: Path
    env: dict[str, str]
    popen: subprocess.Popen[bytes] = field(init=False)

    def __post_init__(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.popen = subprocess.Popen(self.command, cwd=ROOT, env=self.env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True)

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def check_alive(self) -> None:
        if not self.alive:
            raise ProcessFailed(f"{self.name} exited with {self.popen.returncode}; log {self.log_path}:\n"
                                f"{self.log_tail()}")

    def wait_for_line(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if text in self.log_tail(1 << 20):
                return
            self.check_alive()
            time.sleep(0.2)
        raise ProcessFailed(f"{self.name} did not print {text!r} in {timeout_s:.0f} s; log {self.log_path}:\n"
                            f"{self.log_tail()}")

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (the node drains), then SIGKILL after timeout_s; returns once the process has exited, so the
        memory it held on the GPU is free for what comes next."""
        if self.popen.poll() is not None:
            return
        os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **extra}
    env.pop("TRITON_INTERPRET", None)  # the nodes compile their kernels (or, on CPU, never use Triton)
    return env


def start_node(role: str, model: Path, flags: Sequence[str], log_dir: Path, env: dict[str, str]) -> tuple[Child,
                                                                                                          str]:
    """Starts `python -m {role}_node`; returns the child and its gRPC address (wait for it with `wait_node`)."""
    port = free_port()
    command = [sys.executable, "-m", f"{role}_node", "--model", str(model), "--host", "127.0.0.1",
               "--port", str(port), *flags]
    child = Child(f"{role} node", command, log_dir / f"{role}-{port}.log", child_env(env))
    return child, f"127.0.0.1:{port}"


def wait_node(child: Child, timeout_s: float) -> None:
    child.wait_for_line("READY", timeout_s)


def start_proxy(model: Path, prefill: str | None, decode: str | Sequence[str], flags: Sequence[str], log_dir: Path,
                timeout_s: float = 120.0) -> tuple[Child, str]:
    """Starts the proxy in front of static nodes (one decode node or several) and returns once its /health
    answers 200."""
    port = free_port()
    decodes = [decode] if isinstance(decode, str) else list(decode)
    nodes = [*(["--prefill", prefill] if prefill else []), *(flag for d in decodes for flag in ("--decode", d))]
    command = [sys.executable, "-m", "proxy", "--model", str(model), *nodes, "--host", "127.0.0.1",
               "--port", str(port), *flags]
    child = Child("proxy", command, log_dir / f"proxy-{port}.log", child_env({}))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return child, url
        except httpx.HTTPError:
            pass
        child.check_alive()
        time.sleep(0.3)
    child.stop()
    raise ProcessFailed(f"the proxy was not healthy in {timeout_s:.0f} s; log {child.log_path}:\n{child.log_tail()}")
