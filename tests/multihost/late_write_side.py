"""One side of tests/multihost/test_late_writes.py, run on a host: `owner` registers a pool of known bytes and makes
progress until told to stop; `reader` reads it over a link the test slows down, gives the read up (timeout or
peer removed), and reports when the connector called it over and whether any byte landed after that.

The two sides and the test meet through files in a folder: `<name>` appears when a step is reached."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from kvtransfer import KVLayout, KVRegion, PeerId, TransferStatus, make_connector
from kvtransfer.common import BlockConnector

LAYOUT = KVLayout("late-writes", "float32", 2, 2, 32, 16, 1)
NUM_BLOCKS = 16
BLOCK_BYTES = 2 * 2 * 2 * 16 * 32 * 4  # 16 KiB: 8 blocks take about 10 s at 100 kbit/s
READ_BLOCKS = list(range(1, 9))
SENTINEL = 0xAB


def _wait_for(folder: Path, name: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not (folder / name).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {name} in {timeout} s")
        time.sleep(0.01)


def _mark(folder: Path, name: str, text: str = "") -> None:
    (folder / f"{name}.tmp").write_text(text)
    (folder / f"{name}.tmp").rename(folder / name)


def _connector(backend: str, device: str, address: str, read_timeout_s: float = 30.0) -> BlockConnector:
    options = {"ucx_devices": device} if backend == "nixl" else {"host": address}
    connector = make_connector(backend, layout=LAYOUT, read_timeout_s=read_timeout_s, **options)
    assert isinstance(connector, BlockConnector)  # its `peers` tells whether a removed peer was disconnected
    return connector


def owner(folder: Path, backend: str, device: str, address: str) -> None:
    pool = np.random.default_rng(1).integers(0, 256, size=(NUM_BLOCKS, BLOCK_BYTES), dtype=np.uint8)
    connector = _connector(backend, device, address)
    (folder / "owner.md").write_bytes(connector.register(KVRegion.from_buffer(pool)))
    _mark(folder, "owner-ready")
    while not (folder / "stop").exists():
        connector.progress()
        time.sleep(0.001)
    connector.close()


def reader(folder: Path, backend: str, device: str, address: str, give_up: str) -> None:
    pool = np.zeros((NUM_BLOCKS, BLOCK_BYTES), dtype=np.uint8)
    connector = _connector(backend, device, address, read_timeout_s=0.5)
    connector.register(KVRegion.from_buffer(pool))
    _wait_for(folder, "owner-ready")
    peer = connector.add_peer((folder / "owner.md").read_bytes())
    assert connector.wait(connector.read(peer, [0], [0]), 30) is TransferStatus.DONE  # connected, at full speed
    _mark(folder, "shape")
    _wait_for(folder, "shaped")
    started = time.monotonic()
    handle = connector.read(peer, READ_BLOCKS, READ_BLOCKS)
    if give_up == "remove":
        connector.wait(handle, 0.2)
        connector.remove_peer(PeerId(peer))
    statuses = []
    while time.monotonic() - started < 2.0:  # past the read timeout: given up, but still landing
        statuses.append(connector.poll(handle).name)
        connector.progress()
        time.sleep(0.005)
    _mark(folder, "unshape")
    while (status := connector.poll(handle)) is TransferStatus.PENDING:
        connector.progress()
        time.sleep(0.005)
    over_s = time.monotonic() - started
    pool[READ_BLOCKS] = SENTINEL  # what a request given these blocks next would write
    settle = time.monotonic() + 3.0
    while time.monotonic() < settle:
        connector.progress()
        time.sleep(0.005)
    overwritten = [b for b in READ_BLOCKS if not (pool[b] == SENTINEL).all()]
    result = {"statuses_before_unshape": sorted(set(statuses)), "status": status.name,
              "reason": connector.failure_reason(handle), "over_s": round(over_s, 2), "overwritten": overwritten,
              "peers": [str(p) for p in connector.peers]}
    _mark(folder, "result", json.dumps(result))
    connector.close()


if __name__ == "__main__":
    role, folder_arg, backend_arg, device_arg, address_arg = sys.argv[1:6]
    if role == "owner":
        owner(Path(folder_arg), backend_arg, device_arg, address_arg)
    else:
        reader(Path(folder_arg), backend_arg, device_arg, address_arg, sys.argv[6])
