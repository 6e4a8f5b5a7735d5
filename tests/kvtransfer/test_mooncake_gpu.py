"""Mooncake's transfer engine on GPU memory: two processes, each with a CUDA KV pool, on one machine.

Needs CUDA and a CUDA build of Mooncake (mooncake-transfer-engine-cuda13; on the H200 box the carry folder's
setup.sh puts it on the path). Runs each protocol a GPU node can use between two processes of one machine:
- `nvlink_intra`: CUDA IPC, installed by Mooncake only when the process starts with MC_INTRANODE_NVLINK=1 (this
  test is the launcher, so it sets it in each peer's environment before Mooncake loads);
- `tcp`: the same build without that variable (no RDMA device): GPU memory staged through host buffers.

The prefill peer's pool starts a few blocks into its cudaMalloc allocation (Mooncake shares whole allocations over
CUDA IPC and must relocate addresses inside them); the decode peer's starts at its allocation's base. Every check
compares the decode peer's whole pool against the seeded patterns, so a block landing where it should not fails
as surely as a missing one. Run with `-s` to see the GB/s lines.
"""

from __future__ import annotations

import functools
import importlib.util
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest
import torch

from tests.kvtransfer.peer_process import DEFAULT_LAYOUT, block_pattern, receive_reply

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(importlib.util.find_spec("mooncake") is None,
                                 reason="Mooncake is not installed (a CUDA build: mooncake-transfer-engine-cuda13)")]

BLOCK_BYTES = 1 << 20  # 1 MiB blocks
NUM_BLOCKS = 288  # 288 MiB per pool
PREFILL_OFFSET_BLOCKS = 3  # the prefill pool starts 3 MiB into its allocation
PREFILL_SEED, DECODE_SEED = 11, 12
PROTOCOL_ENV = {"nvlink_intra": {"MC_INTRANODE_NVLINK": "1"}, "tcp": {}}


def serve(conn: Connection, protocol: str, env: dict[str, str], seed: int, offset_blocks: int) -> None:
    """A peer: a CUDA pool filled with `block_pattern(seed)`, registered with a Mooncake connector, serving
    commands while it makes progress (as a node's loop would)."""
    os.environ.pop("MC_INTRANODE_NVLINK", None)  # the environment this launcher chooses, before Mooncake loads
    os.environ.update({"MC_TRANSFER_TIMEOUT": "30", **env})
    from kvtransfer import KVLayout, KVRegion, PeerId, TransferError, make_connector

    backing = torch.zeros((offset_blocks + NUM_BLOCKS, BLOCK_BYTES), dtype=torch.uint8, device="cuda:0")
    kv = backing[offset_blocks:]
    kv.copy_(torch.from_numpy(block_pattern(seed, NUM_BLOCKS, BLOCK_BYTES)))
    torch.cuda.synchronize()  # Mooncake's copies are not ordered after torch's stream: write the pool first
    try:
        connector = make_connector("mooncake", layout=KVLayout(**DEFAULT_LAYOUT), protocol=protocol,
                                   read_timeout_s=30.0)
        metadata = connector.register(KVRegion.from_buffer(kv))
    except Exception as e:  # the test shows why the peer could not start
        conn.send(("error", (type(e).__name__, str(e), isinstance(e, TransferError))))
        return
    conn.send(("ok", (metadata, connector.agent_name)))
    inbox: list[tuple[str, bytes]] = []

    def read(peer: str, remote_ids: list[int], local_ids: list[int]) -> dict[str, Any]:
        started = time.perf_counter()
        handle = connector.read(PeerId(peer), remote_ids, local_ids)
        status = connector.wait(handle, 60.0)
        return {"status": status.name, "reason": connector.failure_reason(handle),
                "seconds": time.perf_counter() - started, "num_descriptors": handle.num_descriptors,
                "num_bytes": handle.num_bytes}

    def notifications(min_count: int, wait_s: float) -> list[tuple[str, bytes]]:
        deadline = time.monotonic() + wait_s
        while len(inbox) < min_count and time.monotonic() < deadline:
            inbox.extend(connector.get_notifications())
            time.sleep(0.001)
        received = list(inbox)
        inbox.clear()
        return received

    commands: dict[str, Callable[..., Any]] = {
        "add_peer": connector.add_peer,
        "read": read,
        "notify": connector.notify,
        "notifications": notifications,
        "blocks": lambda: kv.cpu().numpy(),
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
        inbox.extend(connector.get_notifications())


class GpuPeer:
    def __init__(self, protocol: str, seed: int, offset_blocks: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self.process = context.Process(target=serve, daemon=True,
                                       args=(child_conn, protocol, PROTOCOL_ENV[protocol], seed, offset_blocks))
        self.process.start()
        child_conn.close()
        self.seed = seed
        self.metadata, self.agent_name = b"", ""

    def wait_ready(self) -> GpuPeer:
        self.metadata, self.agent_name = self._receive(120.0)
        return self

    def call(self, command: str, *args: Any, timeout: float = 120.0) -> Any:
        self._conn.send((command, args))
        return self._receive(timeout)

    def _receive(self, timeout: float) -> Any:
        # a GPU peer dies loudly (CUDA, Mooncake): its stderr above the error says why
        return receive_reply(self._conn, self.process, "GPU peer", timeout)

    @functools.cached_property
    def pattern(self) -> np.ndarray:
        """The pool's initial bytes, computed here from the seed (the oracle), not read back from the peer."""
        return block_pattern(self.seed, NUM_BLOCKS, BLOCK_BYTES)

    def initial_blocks(self) -> np.ndarray:
        return self.pattern

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self._conn.send(("exit", ()))
                self.process.join(30)
            except (BrokenPipeError, OSError):
                pass
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        self._conn.close()


class GpuPair:
    def __init__(self, protocol: str) -> None:
        self.protocol = protocol
        self.prefill = GpuPeer(protocol, PREFILL_SEED, PREFILL_OFFSET_BLOCKS)
        self.decode = GpuPeer(protocol, DECODE_SEED, 0)
        self.prefill.wait_ready()
        self.decode.wait_ready()
        self.prefill_id = self.decode.call("add_peer", self.prefill.metadata)
        self.decode_id = self.prefill.call("add_peer", self.decode.metadata)

    def read_lands_exactly(self, remote_ids: list[int], local_ids: list[int]) -> dict[str, Any]:
        before = self.decode.call("blocks")
        result = self.decode.call("read", self.prefill_id, remote_ids, local_ids)
        assert result["status"] == "DONE", result
        expected = before.copy()
        expected[local_ids] = self.prefill.initial_blocks()[remote_ids]
        after = self.decode.call("blocks")
        changed = sorted(set(np.flatnonzero((after != before).any(axis=1)).tolist()) - set(local_ids))
        assert changed == [], f"blocks outside the read changed: {changed[:10]}"
        np.testing.assert_array_equal(after, expected)
        return result

    def stop(self) -> None:
        self.prefill.stop()
        self.decode.stop()


@pytest.fixture(scope="module", params=sorted(PROTOCOL_ENV))
def pair(request: pytest.FixtureRequest) -> Iterator[GpuPair]:
    gpu_pair = GpuPair(request.param)
    try:
        yield gpu_pair
    finally:
        gpu_pair.stop()


def scattered_ids() -> tuple[list[int], list[int]]:
    """128 blocks that cannot coalesce: even remote ids, and local ids running backwards over odd ones."""
    remote = list(range(0, 256, 2))
    local = list(range(255, 0, -2))
    return remote, local


def test_gpu_pools_start_untouched(pair: GpuPair) -> None:
    np.testing.assert_array_equal(pair.decode.call("blocks"), pair.decode.initial_blocks())
    np.testing.assert_array_equal(pair.prefill.call("blocks"), pair.prefill.initial_blocks())


def test_gpu_coalesced_read_lands_exactly_as_one_descriptor(pair: GpuPair) -> None:
    remote, local = list(range(16, 272)), list(range(0, 256))  # 256 MiB, one run
    result = pair.read_lands_exactly(remote, local)
    assert (result["num_descriptors"], result["num_bytes"]) == (1, 256 * BLOCK_BYTES)


def test_gpu_scattered_read_lands_exactly(pair: GpuPair) -> None:
    remote, local = scattered_ids()
    result = pair.read_lands_exactly(remote, local)
    assert result["num_descriptors"] == 128


def test_gpu_read_of_the_last_blocks_and_a_repeated_source(pair: GpuPair) -> None:
    # the prefill pool's last block ends NUM_BLOCKS + 3 MiB into its allocation: relocation must get it right
    pair.read_lands_exactly([NUM_BLOCKS - 1, NUM_BLOCKS - 1, 0], [280, 281, 287])


def test_gpu_notifications_reach_the_other_side(pair: GpuPair) -> None:
    pair.decode.call("notify", pair.prefill_id, b"release t-1")
    assert pair.prefill.call("notifications", 1, 10.0) == [(pair.decode.agent_name, b"release t-1")]
    pair.prefill.call("notify", pair.decode_id, b"lease t-2")
    assert pair.decode.call("notifications", 1, 10.0) == [(pair.prefill.agent_name, b"lease t-2")]


def test_gpu_read_throughput_is_reported(pair: GpuPair) -> None:
    """Not a pass/fail bound: prints the median GB/s (1e9 bytes/s) of five reads after a warm-up."""
    cases = {"256 MiB one descriptor": (list(range(16, 272)), list(range(0, 256))),
             "128 x 1 MiB scattered": scattered_ids()}
    for name, (remote, local) in cases.items():
        rates = []
        for attempt in range(6):
            result = pair.decode.call("read", pair.prefill_id, remote, local)
            assert result["status"] == "DONE", result
            if attempt:
                rates.append(result["num_bytes"] / result["seconds"] / 1e9)
        print(f"\nMOONCAKE-GPU protocol={pair.protocol} case={name!r} descriptors={result['num_descriptors']} "
              f"median_gb_s={statistics.median(rates):.1f} best_gb_s={max(rates):.1f}")
