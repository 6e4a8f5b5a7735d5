"""The harness itself: hosts reach each other over TCP, a cut link fails and comes back, tbf shaping slows a
transfer, kill_all leaves no process, and no namespace outlives its test (a failed one, or a SIGKILLed run)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.multihost.hosts import Host, Hosts, namespaces

pytestmark = pytest.mark.multihost
ROOT = Path(__file__).resolve().parents[2]
PORT = 9000  # each host is a network namespace of its own: no other process can hold it

# Echoes one line per connection, for as many connections as come.
ECHO_SERVER = f"""
import socket
server = socket.create_server(("0.0.0.0", {PORT}))
while True:
    conn, _ = server.accept()
    with conn:
        conn.sendall(conn.recv(1024))
"""
# Streams zeros to each connection until the client goes away.
SOURCE_SERVER = f"""
import socket
server = socket.create_server(("0.0.0.0", {PORT}))
chunk = bytes(64 * 1024)
while True:
    conn, _ = server.accept()
    try:
        while True:
            conn.sendall(chunk)
    except OSError:
        conn.close()
"""


def _echo(ip: str, timeout: float = 1.0) -> bytes:
    with socket.create_connection((ip, PORT), timeout=timeout) as conn:
        conn.sendall(b"ping")
        return conn.recv(1024)


def _wait_for_server(ip: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((ip, PORT), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _received_bytes_per_second(ip: str, seconds: float) -> float:
    """What a client receives from the source server in `seconds` (received, so buffers cannot inflate it)."""
    with socket.create_connection((ip, PORT), timeout=5) as conn:
        received, start = 0, time.monotonic()
        while (elapsed := time.monotonic() - start) < seconds:
            received += len(conn.recv(1 << 20))
    return received / elapsed


def test_two_hosts_reach_each_other_over_tcp(two_hosts: Hosts, tmp_path: Path) -> None:
    server, client = two_hosts
    server.run([sys.executable, "-c", ECHO_SERVER], log_path=tmp_path / "echo.log")
    client.call(_wait_for_server, server.ip)
    assert client.call(_echo, server.ip) == b"ping"
    assert server.ip != client.ip and server.ip.rsplit(".", 1)[0] == client.ip.rsplit(".", 1)[0]


def test_a_cut_link_fails_connections_and_restore_brings_them_back(two_hosts: Hosts, tmp_path: Path) -> None:
    server, client = two_hosts
    server.run([sys.executable, "-c", ECHO_SERVER], log_path=tmp_path / "echo.log")
    client.call(_wait_for_server, server.ip)
    server.cut()
    with pytest.raises(OSError):  # a timeout (the bridge drops the SYN) or "no route to host"
        client.call(_echo, server.ip)
    with pytest.raises(OSError):  # the cut host has no route at all
        server.call(_echo, client.ip)
    server.restore()
    assert client.call(_echo, server.ip, 5.0) == b"ping"


def test_tbf_shaping_lowers_throughput(two_hosts: Hosts, tmp_path: Path) -> None:
    server, client = two_hosts
    server.run([sys.executable, "-c", SOURCE_SERVER], log_path=tmp_path / "source.log")
    client.call(_wait_for_server, server.ip)
    unshaped = client.call(_received_bytes_per_second, server.ip, 2.0)
    server.shape(rate="8mbit")
    shaped = client.call(_received_bytes_per_second, server.ip, 2.0)
    cap = 8e6 / 8  # bytes/s
    assert shaped < 0.5 * unshaped, (shaped, unshaped)
    assert shaped < 1.5 * cap, f"{shaped:.0f} B/s through an 8mbit link"
    server.unshape()
    assert client.call(_received_bytes_per_second, server.ip, 0.5) > 2 * cap


def test_kill_all_leaves_no_process_even_one_that_left_the_session(two_hosts: Hosts, tmp_path: Path) -> None:
    host = two_hosts[0]
    escaping = ("import subprocess, time; subprocess.Popen(['sleep', '1000'], start_new_session=True); "
                "time.sleep(1000)")
    started = [host.run([sys.executable, "-c", escaping], log_path=tmp_path / "escaping.log"),
               host.run(["sleep", "1000"])]
    deadline = time.monotonic() + 10
    while len(host.pids()) < 3:  # python, the sleep it left behind in a session of its own, and sleep
        assert time.monotonic() < deadline, host.pids()
        time.sleep(0.02)
    host.kill_all()
    assert host.pids() == []
    assert [p.poll() for p in started] == [-signal.SIGKILL] * 2


def test_closing_removes_namespaces_and_processes_when_the_test_fails(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="the test failed"), Hosts(2) as hosts:
        names = hosts.namespaces
        sleeper = hosts[1].run(["sleep", "1000"])
        assert set(names) <= set(namespaces())
        raise RuntimeError("the test failed")
    assert not set(names) & set(namespaces())
    assert sleeper.poll() == -signal.SIGKILL


def test_namespaces_of_a_killed_run_are_swept_by_the_next(tmp_path: Path) -> None:
    script = ("import os, signal, sys; from tests.multihost.hosts import Hosts; h = Hosts(1); "
              "h[0].run(['sleep', '1000']); print(' '.join(h.namespaces), flush=True); "
              "os.kill(os.getpid(), signal.SIGKILL)")
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert run.returncode == -signal.SIGKILL, run.stderr
    left = run.stdout.split()
    assert len(left) == 2 and set(left) <= set(namespaces())  # no finalizer ran
    with Hosts(1):
        assert not set(left) & set(namespaces())


def test_each_host_has_its_own_pid_namespace(two_hosts: Hosts) -> None:
    """UCX (and Tandem's ipc backend) read a peer's memory directly when it shares their PID namespace."""
    seen = {os.readlink("/proc/self/ns/pid")}
    for host in two_hosts:
        host.run(["sleep", "1000"])
        seen.add(os.readlink(f"/proc/{_wait_for_command(host, b'sleep')}/ns/pid"))
    assert len(seen) == 3


def _wait_for_command(host: Host, command: bytes) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for pid in host.pids():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] == command:
                    return pid
        time.sleep(0.02)
    raise TimeoutError(f"no {command!r} on {host}")
