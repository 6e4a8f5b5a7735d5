"""Several "hosts" on one Linux box: network namespaces joined by a bridge, for tests that cross a network.

    Hosts(3) ─┬─ tnd-<pid>-<n>-br   the bridge's own namespace: bridge br0, one port per host (p<i>)
              ├─ tnd-<pid>-<n>-h0   eth0 10.77.<k>.1/24, lo up ── veth ── p0 in the bridge namespace
              ├─ tnd-<pid>-<n>-h1   eth0 10.77.<k>.2/24
              └─ tnd-<pid>-<n>-h2   eth0 10.77.<k>.3/24

Nothing touches the root namespace: its links, addresses and routes stay as they were, and the hosts reach only
one another (each namespace holds only its own eth0 and lo). `k` is unique to the run and avoids the subnets of
the root namespace's routes, so logs never show an address that could be mistaken for a real one.

Cleanup: `close()` kills every process in the namespaces, then deletes them (the veths and the bridge go with
them). It runs on `__exit__`, from a `weakref.finalize` (which also runs at interpreter exit) and is idempotent;
namespaces left by a run that was SIGKILLed (its pid gone) are swept when the next `Hosts` starts.

Needs root and iproute2 (`ip`, `tc`); `skip_reason()` says why it cannot run. Names are short because Linux
limits interface names to 15 characters.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

PREFIX = "tnd-"
DEVICE = "eth0"  # each host's interface, the name to give UCX (--ucx-devices) or anything that binds by device
_CLONE_NEWNET = 0x40000000
_sequence = itertools.count()
_T = TypeVar("_T")


def host_environment() -> dict[str, str]:
    """A process's environment on a host: no InfiniBand modules (docs/environment.md#ucx-and-nixl), quiet NIXL, and
    neither the loopback device nor Triton's interpreter a test run may carry."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("TRITON_INTERPRET", "TANDEM_UCX_DEVICES", "UCX_NET_DEVICES", "UCX_TLS")}
    return {**env, "PYTHONUNBUFFERED": "1", "UCX_MODULES": "^ib", "NIXL_LOG_LEVEL": "WARN"}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def skip_reason() -> str | None:
    """Why `Hosts` cannot run here (None: it can): not root, no iproute2, or namespaces cannot be made."""
    if os.geteuid() != 0:
        return "multi-host tests need root (network namespaces, veth, bridge)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"multi-host tests need iproute2's `{tool}`"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespace_pids(namespace: str) -> list[int]:
    result = _ip("netns", "pids", namespace, check=False)
    return [int(p) for p in result.stdout.split() if p.isdigit() and int(p) != os.getpid()]


def _delete_namespace(namespace: str) -> None:
    for pid in _namespace_pids(namespace):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _ip("netns", "del", namespace, check=False)


def namespaces() -> list[str]:
    """Every namespace name `ip netns list` shows."""
    return [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]


def sweep_stale() -> None:
    """Deletes namespaces of earlier runs whose process is gone (a SIGKILLed pytest runs no finalizer)."""
    for name in namespaces():
        match = re.fullmatch(rf"{PREFIX}(\d+)-.*", name)
        if match and not _pid_alive(int(match.group(1))):
            _delete_namespace(name)


def _free_subnet() -> int:
    """A third octet for 10.77.<k>.0/24 that no route of the root namespace covers, different per run."""
    routes = _ip("-4", "route", "show", "table", "all").stdout
    used = {int(m) for m in re.findall(r"\b10\.77\.(\d+)\.", routes)}
    start = (os.getpid() * 7 + next(_sequence)) % 250
    for k in ((start + i) % 250 + 1 for i in range(250)):
        if k not in used:
            return k
    raise RuntimeError("no free 10.77.<k>.0/24 subnet")


class Host:
    """One namespace with `DEVICE` at `ip` (and lo up). Processes it starts run in their own session."""

    def __init__(self, namespace: str, ip: str, bridge_namespace: str, bridge_port: str) -> None:
        self.namespace, self.ip, self.device = namespace, ip, DEVICE
        self._bridge_namespace, self._bridge_port = bridge_namespace, bridge_port
        self._processes: list[subprocess.Popen[bytes]] = []
        self._logs: list[Any] = []
        self._init: subprocess.Popen[bytes] | None = None
        self._init_pids: set[int] = set()

    def start_pid_namespace(self) -> None:
        """Gives the host a PID namespace of its own, held by a sleeping init: what `run` starts joins it. With one
        PID namespace UCX takes two processes for one machine and reads memory with CMA (process_vm_readv) whatever
        network they are on; a host of its own makes it use the network, as between real machines."""
        self._init = subprocess.Popen(["ip", "netns", "exec", self.namespace, "unshare", "--pid", "--fork",
                                       "--kill-child", "sleep", "infinity"], stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 10
        while len(pids := set(_namespace_pids(self.namespace))) < 2:  # unshare, and its child: the init
            if time.monotonic() > deadline or self._init.poll() is not None:
                raise RuntimeError(f"the PID namespace of {self.namespace} did not start")
            time.sleep(0.01)
        self._init_pids = pids

    def __repr__(self) -> str:
        return f"Host({self.namespace}, {self.ip})"

    def run(self, argv: Sequence[str], env: dict[str, str] | None = None, log_path: Path | None = None,
            cwd: Path | None = None) -> subprocess.Popen[bytes]:
        """Starts `argv` in this host (`ip netns exec`), in a new session (killed as a group); stdout and stderr go
        to `log_path` (else nowhere). `env` is the whole environment (default: this process's)."""
        log = log_path.open("ab") if log_path is not None else None
        if log is not None:
            self._logs.append(log)
        enter = ["ip", "netns", "exec", self.namespace]
        if self._init is not None:  # the init is the child of unshare (the Popen)
            init_pid = next(p for p in self._init_pids if p != self._init.pid)
            enter = ["nsenter", "--target", str(init_pid), "--pid", "--", *enter]
        output = log or subprocess.DEVNULL
        popen = subprocess.Popen([*enter, *argv], env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=output,
                                 stderr=subprocess.STDOUT if log else subprocess.DEVNULL, start_new_session=True)
        self._processes.append(popen)
        return popen

    def call(self, fn: Callable[..., _T], *args: Any, timeout: float = 120.0) -> _T:
        """`fn(*args)` on a thread of this process that entered the host's network namespace (setns affects the
        calling thread only), so that sockets it opens live on this host; returns its result or raises its error."""
        outcome: dict[str, Any] = {}

        def target() -> None:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                fd = os.open(f"/run/netns/{self.namespace}", os.O_RDONLY)
                try:
                    if libc.setns(fd, _CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), f"setns into {self.namespace}")
                finally:
                    os.close(fd)
                outcome["value"] = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                outcome["error"] = e

        thread = threading.Thread(target=target, daemon=True, name=f"in-{self.namespace}")
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} did not finish in {timeout} s on {self}")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]  # type: ignore[no-any-return]

    def wait_healthy(self, url: str, timeout: float = 120.0) -> None:
        """Returns once `url`/health answers 200 from this host (TimeoutError after `timeout`)."""
        import httpx

        def poll() -> None:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            raise TimeoutError(f"{url} not healthy in {timeout:g} s")

        self.call(poll, timeout=timeout + 10)

    def cut(self) -> None:
        """Takes the host's link down: nothing reaches it or leaves it until `restore()`."""
        _ip("-n", self.namespace, "link", "set", self.device, "down")

    def restore(self) -> None:
        _ip("-n", self.namespace, "link", "set", self.device, "up")
        _wait_until_up(self.namespace, self.device)

    def shape(self, rate: str = "10mbit", latency: str = "50ms") -> None:
        """Caps the host's link at `rate` in both directions (tc tbf on both ends of its veth). A packet that would
        wait longer than `latency` in the queue is dropped: at a low rate a short one drops most packets, and TCP
        backs off for seconds to minutes (a brownout); a long one only slows the link."""
        for namespace, device in ((self.namespace, self.device), (self._bridge_namespace, self._bridge_port)):
            subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev", device, "root",
                            "tbf", "rate", rate, "burst", "32kbit", "latency", latency],
                           check=True, capture_output=True, timeout=30)

    def unshape(self) -> None:
        for namespace, device in ((self.namespace, self.device), (self._bridge_namespace, self._bridge_port)):
            subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "del", "dev", device, "root"],
                           capture_output=True, timeout=30)

    def link_bytes(self) -> tuple[int, int]:
        """(received, sent) bytes on the host's interface so far."""
        stats = json.loads(_ip("-n", self.namespace, "-s", "-j", "link", "show", "dev", self.device).stdout)[0]
        return int(stats["stats64"]["rx"]["bytes"]), int(stats["stats64"]["tx"]["bytes"])

    def pids(self) -> list[int]:
        """Every process whose network namespace is this host's (whoever started it), but the host's init."""
        return [pid for pid in _namespace_pids(self.namespace) if pid not in self._init_pids]

    def kill_all(self) -> None:
        """SIGKILLs what `run` started (their whole sessions) and anything else left in the namespace."""
        for popen in self._processes:
            if popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(popen.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while (pids := self.pids()) and time.monotonic() < deadline:  # SIGKILL is delivered, not waited for
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)
        for popen in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(10)
        self._processes.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()


def _wait_until_up(namespace: str, device: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while "LOWER_UP" not in _ip("-n", namespace, "link", "show", device).stdout:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{device} in {namespace} did not come up")
        time.sleep(0.02)


def _teardown(hosts: list[Host], bridge_namespace: str) -> None:
    for host in hosts:
        host.kill_all()
        if host._init is not None:  # killing it kills whatever is left in its PID namespace
            with contextlib.suppress(ProcessLookupError):
                os.killpg(host._init.pid, signal.SIGKILL)
            host._init.wait(10)
    for name in [host.namespace for host in hosts] + [bridge_namespace]:
        _delete_namespace(name)


class Hosts:
    """`with Hosts(n) as hosts:` n hosts on one bridge; `hosts[i]` is a `Host`."""

    def __init__(self, count: int, pid_namespaces: bool = True) -> None:
        """`pid_namespaces`: each host gets a PID namespace of its own (see `Host.start_pid_namespace`)."""
        assert 1 <= count <= 200, f"between 1 and 200 hosts, got {count}"
        sweep_stale()
        base = f"{PREFIX}{os.getpid()}-{next(_sequence)}"
        subnet = _free_subnet()
        self.subnet = f"10.77.{subnet}.0/24"
        self.bridge_namespace = f"{base}-br"
        self.hosts: list[Host] = []
        self._finalizer = weakref.finalize(self, _teardown, self.hosts, self.bridge_namespace)
        try:
            _ip("netns", "add", self.bridge_namespace)
            _ip("-n", self.bridge_namespace, "link", "add", "br0", "type", "bridge", "forward_delay", "0")
            _ip("-n", self.bridge_namespace, "link", "set", "br0", "up")
            for i in range(count):
                self._add_host(f"{base}-h{i}", f"10.77.{subnet}.{i + 1}", f"p{i}")
            for host in self.hosts:
                _wait_until_up(host.namespace, host.device)
                if pid_namespaces:
                    host.start_pid_namespace()
        except BaseException:
            self.close()
            raise

    def _add_host(self, namespace: str, ip: str, port: str) -> None:
        _ip("netns", "add", namespace)
        # listed before its links are made: a failure below still deletes the namespace
        self.hosts.append(Host(namespace, ip, self.bridge_namespace, port))
        # made inside the bridge namespace, its peer moved straight into the host's: no name in the root namespace
        _ip("-n", self.bridge_namespace, "link", "add", port, "type", "veth", "peer", "name", DEVICE,
            "netns", namespace)
        _ip("-n", self.bridge_namespace, "link", "set", port, "master", "br0", "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        _ip("-n", namespace, "addr", "add", f"{ip}/24", "dev", DEVICE)
        _ip("-n", namespace, "link", "set", DEVICE, "up")

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kills every host's processes and deletes the namespaces (idempotent)."""
        self._finalizer()

    @property
    def namespaces(self) -> list[str]:
        return [self.bridge_namespace, *(host.namespace for host in self.hosts)]
