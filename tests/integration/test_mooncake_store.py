"""MooncakeKVStore (kvtransfer/kv_store.py) against a real mooncake_master on loopback: a value written by one
process is read by another from the writer's segment, prefixes stop at the first miss, and a dead master makes
quick misses, never errors, until a master on the same port takes over."""

from __future__ import annotations

import ctypes.util
import hashlib
import importlib.util
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtransfer.kv_store import MooncakeKVStore, master_command, pack_block, store_key, unpack_block

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("mooncake") is None,
                       reason="Mooncake is not installed (pip install mooncake-transfer-engine-non-cuda)"),
    pytest.mark.skipif(ctypes.util.find_library("ibverbs") is None,
                       reason="Mooncake needs libibverbs (apt-get install --no-install-recommends libibverbs1)"),
]

BLOCK_BYTES = 64 << 10
CALL_BOUND_S = 3.0  # what any call may take while the master is dead


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Master:
    """A mooncake_master on a fixed loopback port that can die and come back."""

    def __init__(self, log_path: Path) -> None:
        self.port, self.log_path = free_port(), log_path
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        command = master_command(self.port)
        if not Path(command[0]).exists() and shutil.which(command[0]) is None:
            pytest.skip("the mooncake_master binary is not installed next to the interpreter")
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # listening: ready
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                assert self.process.poll() is None, f"mooncake_master exited, see {self.log_path}"
                time.sleep(0.05)
        raise AssertionError(f"mooncake_master did not listen on {self.address} within 10 s")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def master(tmp_path: Path) -> Iterator[Master]:
    running = Master(tmp_path / "mooncake_master.log")
    running.start()
    yield running
    running.kill()


def block(index: int) -> tuple[str, list[int], bytes]:
    """The key, token ids and KV bytes of test block `index` (any process derives the same)."""
    token_ids = list(range(index * 16, index * 16 + 16))
    data = hashlib.shake_256(f"block {index}".encode()).digest(BLOCK_BYTES)
    return store_key("test", hashlib.sha256(str(token_ids).encode()).digest()), token_ids, data


WRITER = """
import sys
from kvtransfer.kv_store import MooncakeKVStore, pack_block
from tests.integration.test_mooncake_store import block
store = MooncakeKVStore(sys.argv[1], segment_bytes=32 << 20, buffer_bytes=8 << 20)
print(store.put_many([(key, pack_block(ids, data)) for key, ids, data in map(block, range(8))]), flush=True)
sys.stdin.readline()
store.close()
"""


def test_a_reader_gets_the_blocks_a_writer_process_put_into_its_own_segment(master: Master) -> None:
    writer = subprocess.Popen([sys.executable, "-c", WRITER, master.address], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              cwd=Path(__file__).parents[2])
    reader = MooncakeKVStore(master.address, segment_bytes=0, buffer_bytes=1 << 20)  # holds nothing itself
    try:
        assert writer.stdout is not None and writer.stdin is not None
        assert writer.stdout.readline().strip() == "8"
        expected = [block(i) for i in range(8)]
        values = reader.get_prefix([key for key, _, _ in expected])  # 8 x 64 KiB through a 1 MiB buffer
        assert len(values) == len(expected)
        for value, (_, ids, data) in zip(values, expected, strict=True):
            assert unpack_block(value, ids, BLOCK_BYTES) == data
        assert (reader.num_gets, reader.num_hits, reader.bytes_read) == (8, 8, sum(map(len, values)))
        writer.stdin.write("\n")
        writer.stdin.flush()
        assert writer.wait(timeout=15) == 0
        assert reader.get_prefix([expected[0][0]]) == []  # the writer left: its segment's values went with it
    finally:
        writer.kill()
        reader.close()


def test_get_prefix_stops_at_the_first_missing_key(master: Master) -> None:
    store = MooncakeKVStore(master.address, segment_bytes=16 << 20, buffer_bytes=4 << 20)
    try:
        blocks = [block(i) for i in range(4)]
        items = [(key, pack_block(ids, data)) for key, ids, data in blocks]
        assert store.put_many([items[0], items[1], items[3]]) == 3
        assert store.get_prefix([key for key, _ in items]) == [items[0][1], items[1][1]]
        assert store.get_prefix([items[2][0], items[3][0]]) == []
        assert store.num_errors == 0
    finally:
        store.close()


def test_a_present_key_counts_as_stored_and_keeps_its_first_value(master: Master) -> None:
    store = MooncakeKVStore(master.address, segment_bytes=16 << 20, buffer_bytes=4 << 20)
    try:
        assert store.put_many([("tandem/test/a", b"first")]) == 1
        assert store.put_many([("tandem/test/a", b"second"), ("tandem/test/b", b"b")]) == 2
        assert store.get_prefix(["tandem/test/a", "tandem/test/b"]) == [b"first", b"b"]
    finally:
        store.close()


def test_batches_larger_than_the_local_buffer_are_split(master: Master) -> None:
    store = MooncakeKVStore(master.address, segment_bytes=32 << 20, buffer_bytes=2 << 20)
    try:
        items = [(f"tandem/test/big{i}", bytes([i]) * (512 << 10)) for i in range(12)]  # 6 MiB
        assert store.put_many(items) == 12
        assert store.get_prefix([key for key, _ in items]) == [value for _, value in items]
        assert store.put_many([("tandem/test/huge", bytes(3 << 20))]) == 0  # bigger than the buffer
    finally:
        store.close()


def test_a_dead_master_gives_bounded_misses_and_a_restarted_one_serves_again(master: Master) -> None:
    store = MooncakeKVStore(master.address, segment_bytes=16 << 20, buffer_bytes=4 << 20, retry_after_s=0.5,
                            call_timeout_s=2.0)
    try:
        assert store.put_many([("tandem/test/before", b"v")]) == 1
        master.kill()
        deadline = time.monotonic() + 6  # past the first timeouts and two breaker periods
        while time.monotonic() < deadline:
            started = time.monotonic()
            assert store.get_prefix(["tandem/test/before"]) == []
            assert store.put_many([("tandem/test/during", b"v")]) == 0
            assert time.monotonic() - started < CALL_BOUND_S
            time.sleep(0.1)
        assert store.num_errors >= 1
        master.start()  # same port, empty: the client reconnects and mounts its segment again
        deadline = time.monotonic() + 30
        while store.put_many([("tandem/test/after", b"w")]) != 1:
            assert time.monotonic() < deadline, "the store did not serve again within 30 s of the restart"
            time.sleep(0.2)
        assert store.get_prefix(["tandem/test/after"]) == [b"w"]
    finally:
        store.close()


def test_a_store_made_before_its_master_starts_connects_once_it_does(tmp_path: Path) -> None:
    master = Master(tmp_path / "mooncake_master.log")  # not started yet
    started = time.monotonic()
    store = MooncakeKVStore(master.address, segment_bytes=16 << 20, buffer_bytes=4 << 20, retry_after_s=0.5)
    try:
        assert time.monotonic() - started < CALL_BOUND_S
        started = time.monotonic()
        assert store.put_many([("tandem/test/early", b"v")]) == 0 and store.get_prefix(["tandem/test/early"]) == []
        assert time.monotonic() - started < CALL_BOUND_S
        master.start()
        deadline = time.monotonic() + 30
        while store.put_many([("tandem/test/late", b"w")]) != 1:
            assert time.monotonic() < deadline, "the store did not connect within 30 s of the master's start"
            time.sleep(0.2)
        assert store.get_prefix(["tandem/test/late"]) == [b"w"]
    finally:
        store.close()
        master.kill()
