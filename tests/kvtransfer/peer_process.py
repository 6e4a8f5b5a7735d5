"""A connector in its own process (spawned), driven over a pipe: the contract suite's two "nodes".

The child owns a KV region filled with a pattern known from its seed (in host memory, or on a GPU for
`device="cuda"` / `"cuda:1"`), registers it, and then serves commands
while calling `connector.progress()` about every millisecond, as a node's loop would. A command that raises comes
back as `RemoteError` carrying the exception's class name, so a test can check the error type without sharing
the objects; the child keeps serving.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

DEFAULT_LAYOUT = {"model": "tiny-test", "dtype": "float32", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8,
                  "block_size": 4, "tp_size": 1}


def block_pattern(seed: int, num_blocks: int, block_bytes: int) -> np.ndarray:
    """The region's initial bytes, [num_blocks, block_bytes] uint8: random, so every block differs."""
    return np.random.default_rng(seed).integers(0, 256, size=(num_blocks, block_bytes), dtype=np.uint8)


def receive_reply(conn: Connection, process: Any, label: str, timeout: float) -> Any:
    """A peer process's answer on `conn`: its value, or RemoteError for its ("error", ...) answers; TimeoutError
    when it does not answer in time, ConnectionError when it died."""
    if not conn.poll(timeout):
        raise TimeoutError(f"{label} pid {process.pid} did not answer in {timeout} s (alive: {process.is_alive()})")
    try:
        kind, value = conn.recv()
    except EOFError:
        process.join(5)
        raise ConnectionError(f"{label} pid {process.pid} died (exit code {process.exitcode})") from None
    if kind == "error":
        raise RemoteError(*value)
    return value


class RemoteError(Exception):
    """An exception raised in the peer process: `type_name` is its class name, `is_transfer_error` whether it is
    a kvtransfer TransferError."""

    def __init__(self, type_name: str, message: str, is_transfer_error: bool) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message
        self.is_transfer_error = is_transfer_error


class PeerProcess:
    """Starts a peer and waits until its region is registered; `call(command, ...)` runs a command there."""

    def __init__(self, backend: str, *, num_blocks: int = 64, block_bytes: int = 4096, seed: int = 0,
                 layout: dict[str, Any] | None = None, read_timeout_s: float = 10.0,
                 env: dict[str, str] | None = None, wait: bool = True, device: str = "cpu",
                 transport: dict[str, Any] | None = None) -> None:
        """`transport`: TransportSettings fields on top of the loopback device (e.g. the auto backend's
        `kv_cross_host_backend`)."""
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self.process = context.Process(
            target=serve, daemon=True,
            args=(child_conn, backend, num_blocks, block_bytes, seed, layout or DEFAULT_LAYOUT, read_timeout_s,
                  env or {}, device, transport or {}))
        self.process.start()
        child_conn.close()
        self.backend, self.num_blocks, self.block_bytes, self.seed = backend, num_blocks, block_bytes, seed
        self.metadata, self.agent_name = b"", ""
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 60.0) -> PeerProcess:
        """Waits until the child has registered its region (start several peers, then wait for each)."""
        if not self.metadata:
            self.metadata, self.agent_name = self._receive(timeout)
        return self

    @property
    def pid(self) -> int:
        assert self.process.pid is not None, "the peer process has not started"
        return self.process.pid

    def initial_blocks(self) -> np.ndarray:
        return block_pattern(self.seed, self.num_blocks, self.block_bytes)

    def call(self, command: str, *args: Any, timeout: float = 20.0) -> Any:
        self._conn.send((command, args))
        return self._receive(timeout)

    def _receive(self, timeout: float) -> Any:
        return receive_reply(self._conn, self.process, f"peer {self.backend}", timeout)

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def kill(self) -> None:
        if self.process.is_alive():
            self.signal(signal.SIGKILL)
        self.process.join(10)

    def stop(self) -> None:
        """Asks the peer to close its connector and exit; kills it if it does not."""
        if self.process.is_alive():
            try:
                self._conn.send(("exit", ()))
                self.process.join(15)
            except (BrokenPipeError, OSError):
                pass
        self.kill()
        self._conn.close()


def assert_read_lands(reader: PeerProcess, peer_id: str, source: PeerProcess, remote_ids: list[int],
                      local_ids: list[int], wait_s: float = 30.0) -> dict[str, Any]:
    """`reader` reads `source`'s blocks (known to it as `peer_id`); its whole region must then hold exactly the
    source's initial blocks at `local_ids` and its own bytes everywhere else. Returns the read's result."""
    before = reader.call("blocks")
    result = reader.call("read", peer_id, remote_ids, local_ids, wait_s)
    assert result["status"] == "DONE", result
    expected = before.copy()
    expected[local_ids] = source.initial_blocks()[remote_ids]
    after = reader.call("blocks")
    changed = sorted(set(np.flatnonzero((after != before).any(axis=1)).tolist()) - set(local_ids))
    assert changed == [], f"blocks outside the read changed: {changed[:10]}"
    np.testing.assert_array_equal(after, expected)
    return dict(result)


def launch_environment(read_timeout_s: float) -> dict[str, str]:
    """What this launcher starts a peer with (a node's launcher does the same): UCX without its InfiniBand modules
    (docs/environment.md#ucx-and-nixl: with ibverbs providers installed, NIXL crashes at exit), and Mooncake's own
    timeout close to the connector's, so a read abandoned on a hung peer does not hold its blocks for 30 s."""
    return {"UCX_MODULES": "^ib", "NIXL_LOG_LEVEL": "WARN",
            "MC_TRANSFER_TIMEOUT": str(max(5, math.ceil(read_timeout_s)))}


def transport_variables() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_", "MC_"))}


def serve(conn: Connection, backend: str, num_blocks: int, block_bytes: int, seed: int, layout: dict[str, Any],
          read_timeout_s: float, env: dict[str, str], device: str = "cpu", transport: dict[str, Any] | None = None
          ) -> None:
    logging.basicConfig(level=logging.WARNING)
    os.environ.update({**launch_environment(read_timeout_s), **env})
    from kvtransfer import KVLayout, KVRegion, PeerId, TransferError, make_connector
    from settings import TransportSettings

    kv = block_pattern(seed, num_blocks, block_bytes)
    pool: Any = kv
    if device != "cpu":  # a GPU pool holding the same pattern, inside a larger allocation as the engine's pool is
        import torch

        pool = torch.zeros((num_blocks + 2, block_bytes), dtype=torch.uint8, device=device)[1:num_blocks + 1]
        pool.copy_(torch.from_numpy(kv))
    launched_with = transport_variables()
    # loopback through the connector's own settings (NIXL: UCX's device list), not through the environment
    options = TransportSettings(**{"ucx_devices": "lo", **(transport or {})}).connector_options(backend)
    connector = make_connector(backend, layout=KVLayout(**layout), read_timeout_s=read_timeout_s, **options)
    region = KVRegion.from_buffer(pool)
    conn.send(("ok", (connector.register(region), connector.agent_name)))
    inbox: list[tuple[str, bytes]] = []

    handles: dict[int, Any] = {}

    def read(peer: str, remote_ids: list[int], local_ids: list[int], wait_s: float) -> dict[str, Any]:
        started = time.monotonic()
        handle = connector.read(PeerId(peer), remote_ids, local_ids)
        handles[handle.transfer_id] = handle
        status = connector.wait(handle, wait_s)
        return {"status": status.name, "reason": connector.failure_reason(handle),
                "seconds": time.monotonic() - started, "num_descriptors": handle.num_descriptors,
                "num_bytes": handle.num_bytes, "transfer_id": handle.transfer_id}

    def wait_read(transfer_id: int, wait_s: float) -> dict[str, Any]:
        """A read started by `read` that had not finished then, waited for again."""
        handle = handles[transfer_id]
        status = connector.wait(handle, wait_s)
        return {"status": status.name, "reason": connector.failure_reason(handle)}

    def notifications(min_count: int, wait_s: float) -> list[tuple[str, bytes]]:
        deadline = time.monotonic() + wait_s
        while len(inbox) < min_count and time.monotonic() < deadline:
            inbox.extend(connector.get_notifications())
            time.sleep(0.001)
        inbox.extend(connector.get_notifications())
        received = list(inbox)
        inbox.clear()
        return received

    def checksum(block_ids: list[int]) -> str:
        from kvtransfer import kv_checksum

        return kv_checksum(region, block_ids)

    def write_blocks(block_ids: list[int], data: np.ndarray) -> None:
        """Overwrites blocks of the registered region in place (a test's own content: FP8 KV blocks)."""
        if pool is kv:
            kv[block_ids] = data
        else:
            import torch

            pool[block_ids] = torch.from_numpy(data).to(pool.device)

    def chosen_backend(peer: str) -> str:
        """The backend `peer` is read with: the auto connector's choice, any other connector's own backend."""
        from kvtransfer.same_host import AutoConnector

        if isinstance(connector, AutoConnector):
            return connector.chosen_backend(PeerId(peer))
        return connector.backend_name

    commands: dict[str, Callable[..., Any]] = {
        "ping": lambda: "pong",
        "add_peer": connector.add_peer,
        "chosen_backend": chosen_backend,
        "remove_peer": connector.remove_peer,
        "read": read,
        "wait_read": wait_read,
        "poll_unknown": lambda: connector.poll(make_foreign_handle()),
        "notify": connector.notify,
        "notifications": notifications,
        "blocks": lambda: kv.copy() if pool is kv else pool.cpu().numpy(),
        "checksum": checksum,
        "write_blocks": write_blocks,
        # what the connector changed in the process environment (a library must leave it alone)
        "environment_changes": lambda: {k: v for k, v in transport_variables().items() if launched_with.get(k) != v},
        "close": connector.close,
    }
    while True:
        if conn.poll(0.001):
            command, args = conn.recv()
            if command == "exit":
                connector.close()
                conn.send(("ok", None))
                return
            try:
                conn.send(("ok", commands[command](*args)))
            except Exception as e:
                conn.send(("error", (type(e).__name__, str(e), isinstance(e, TransferError))))
        try:
            inbox.extend(connector.get_notifications())
        except TransferError:  # closed: nothing to make progress on
            pass


def make_foreign_handle() -> Any:
    from kvtransfer import PeerId, TransferHandle

    return TransferHandle(transfer_id=10**9, peer=PeerId("nobody"), num_blocks=1, num_descriptors=1, num_bytes=1)
