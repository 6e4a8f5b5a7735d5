"""Real node and proxy processes on loopback for integration tests: free ports, readiness, clean stops."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
# Ports this process handed out. Processes are started side by side, each before the last one has bound its port,
# so the kernel could offer a port again that a child is still about to take.
_handed_out: set[int] = set()


def free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port


class Process:
    """A `python -m MODULE ...` child whose output goes to a log file (read on failure)."""

    def __init__(self, module: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.module = module
        self.log_path = log_dir / f"{module}-{time.monotonic_ns()}.log"
        self._log = self.log_path.open("w")
        # the loopback transport, as `tandem serve` gives a single-machine cluster: UCX's devices as a setting (its
        # TANDEM_* layer), and what UCX reads only from the environment (no InfiniBand modules:
        # docs/environment.md#ucx-and-nixl)
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TANDEM_UCX_DEVICES": "lo", "UCX_MODULES": "^ib",
                    "NIXL_LOG_LEVEL": "WARN", **(env or {})}
        full_env.pop("TRITON_INTERPRET", None)
        self.popen = subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=full_env,
                                      stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_for_line(self, text: str, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log():
                return
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.module} exited with {self.popen.returncode}:\n{self.log()[-4000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"{self.module} did not print {text!r} in {timeout} s:\n{self.log()[-4000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        self._log.close()

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None


def node_args(model: Path, port: int, backend: str = "nixl") -> list[str]:
    """A test node's flags: a small KV pool (64 blocks of 4 tokens), float32, quiet logs."""
    return ["--model", str(model), "--dtype", "float32", "--port", str(port), "--kv-backend", backend,
            "--block-size", "4", "--num-kv-blocks", "64", "--max-num-seqs", "8", "--log-level", "WARNING"]


def launch_node(role: str, model: Path, backend: str, log_dir: Path, extra: list[str] | None = None,
                env: dict[str, str] | None = None, port: int | None = None) -> tuple[Process, str]:
    """A node process, started but not yet serving: `process.wait_for_line("READY")` waits for it. Nodes
    launched together load side by side (most of a node's start is importing torch and loading the model)."""
    port = port or free_port()
    process = Process(f"{role}_node", [*node_args(model, port, backend), *(extra or [])], log_dir, env)
    return process, f"127.0.0.1:{port}"


def start_node(role: str, model: Path, backend: str, log_dir: Path, extra: list[str] | None = None,
               env: dict[str, str] | None = None, port: int | None = None) -> tuple[Process, str]:
    process, address = launch_node(role, model, backend, log_dir, extra, env, port)
    process.wait_for_line("READY")
    return process, address


def launch_proxy(model: Path, prefill: str | None, decode: str | None, log_dir: Path, extra: list[str] | None = None
                 ) -> tuple[Process, str]:
    """A proxy process, started but not yet answering: `wait_for_proxy` waits for it."""
    port = free_port()
    nodes = [*(["--prefill", prefill] if prefill else []), *(["--decode", decode] if decode else [])]
    process = Process("proxy", ["--model", str(model), *nodes,
                                "--port", str(port), "--log-level", "warning", "--request-timeout", "60",
                                *(extra or [])], log_dir)
    return process, f"http://127.0.0.1:{port}"


def start_proxy(model: Path, prefill: str | None, decode: str | None, log_dir: Path, extra: list[str] | None = None
                ) -> tuple[Process, str]:
    """A proxy in front of static nodes, or (prefill and decode None, `--registry` in extra) of registered ones;
    returns once its /health answers 200."""
    process, url = launch_proxy(model, prefill, decode, log_dir, extra)
    wait_for_proxy(process, url)
    return process, url


def wait_for_proxy(process: Process, url: str) -> None:
    """Returns once the proxy's /health answers 200 (it has a decode node up)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if not process.alive:
            raise RuntimeError(f"proxy exited:\n{process.log()[-4000:]}")
        time.sleep(0.2)
    raise TimeoutError(f"proxy not healthy:\n{process.log()[-4000:]}")


class MooncakeMaster:
    """A real mooncake_master (the Mooncake Store's, kvtransfer/kv_store.py) on a loopback port that stays its own
    across restarts (an empty store each time: the master keeps no state on disk)."""

    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        self.log_path = log_dir / f"mooncake_master-{self.port}.log"
        self.popen: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def start(self) -> None:
        from kvtransfer.kv_store import master_command

        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(master_command(self.port), stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        deadline = time.monotonic() + 15
        while True:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if self.popen.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"mooncake_master did not start:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.alive:
            assert self.popen is not None
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait()


class RedisServer:
    """A real redis-server on a free loopback port, without persistence, stopped by its pid."""

    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.log_dir = log_dir
        self.log_path = log_dir / f"redis-{self.port}.log"
        self._start()

    def restart(self) -> None:
        """Stops the server and starts an empty one on the same port (a Redis restart without persistence)."""
        self.stop()
        self._start()

    def _start(self) -> None:
        self.popen = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--dir", str(self.log_dir), "--logfile", str(self.log_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self.popen.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


@contextlib.contextmanager
def pd_cluster(model: Path, backend: str, log_dir: Path, node_flags: list[str] | None = None,
               proxy_flags: list[str] | None = None, ready_timeout_s: float = 90.0) -> Iterator[str]:
    """A prefill node, a decode node and a proxy in front of them that hands every request from P to D
    (`--colocate-max-tokens 0`); yields the proxy's URL and stops all three on exit, also when one fails to start."""
    processes: list[Process] = []
    try:
        prefill, prefill_address = launch_node("prefill", model, backend, log_dir, node_flags)
        processes.append(prefill)
        decode, decode_address = launch_node("decode", model, backend, log_dir, node_flags)
        processes.append(decode)
        for node in (prefill, decode):
            node.wait_for_line("READY", timeout=ready_timeout_s)
        proxy, url = start_proxy(model, prefill_address, decode_address, log_dir,
                                 ["--colocate-max-tokens", "0", *(proxy_flags or [])])
        processes.append(proxy)
        yield url
    finally:
        for process in reversed(processes):
            process.stop()
