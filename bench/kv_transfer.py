"""KV transfer throughput over the kvtransfer connectors: two processes on loopback, host memory.

    python bench/kv_transfer.py [--backend nixl|mooncake|all] [--repeats 7] [--json FILE]

For each backend a "prefill" process registers a 128 MiB region of 32 KiB blocks and keeps its connector making
progress; this ("decode") process registers its own region and READs from it:
- one 64 MiB region: 2048 consecutive blocks, one descriptor;
- 1,000 scattered 32 KiB blocks: ids drawn from even block numbers on both sides, so nothing coalesces
  (1,000 descriptors).
Each read is timed from `read()` until `poll()` says DONE; prints the median and best GB/s (1 GB = 1e9 bytes).
The first read of each case is a warm-up (connection set-up, page faults) and is not counted.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtransfer import (  # noqa: E402
    BACKENDS,
    Connector,
    KVLayout,
    KVRegion,
    PeerId,
    TransferStatus,
    kv_checksum,
    make_connector,
)

BLOCK_BYTES = 32 << 10
NUM_BLOCKS = 4096  # 128 MiB per side
LAYOUT = KVLayout(model="bench", dtype="bfloat16", num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
                  tp_size=1)


def serve(conn: Connection, backend: str) -> None:
    """The prefill side: owns the blocks being read; makes progress until told to stop."""
    kv = np.random.default_rng(0).integers(0, 256, size=(NUM_BLOCKS, BLOCK_BYTES), dtype=np.uint8)
    with make_connector(backend, layout=LAYOUT) as connector:
        region = KVRegion.from_buffer(kv)
        conn.send(connector.register(region))
        while True:
            if conn.poll(0.001):
                block_ids = conn.recv()
                if block_ids is None:
                    return
                conn.send(kv_checksum(region, block_ids))
            connector.progress()


def time_read(connector: Connector, peer: PeerId, remote_ids: list[int], local_ids: list[int]) -> tuple[float, int]:
    """(seconds, descriptors) of one read."""
    start = time.perf_counter()
    handle = connector.read(peer, remote_ids, local_ids)
    status = connector.wait(handle, timeout_s=60.0)
    elapsed = time.perf_counter() - start
    if status is not TransferStatus.DONE:
        raise RuntimeError(f"read failed: {connector.failure_reason(handle)}")
    return elapsed, handle.num_descriptors


def bench_backend(backend: str, repeats: int) -> list[dict[str, object]]:
    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    server = context.Process(target=serve, args=(child_conn, backend), daemon=True)
    server.start()
    kv = np.full((NUM_BLOCKS, BLOCK_BYTES), 7, dtype=np.uint8)  # touched, so no page faults inside timings
    results = []
    try:
        if not conn.poll(60):
            raise RuntimeError(f"the {backend} prefill process did not start")
        with make_connector(backend, layout=LAYOUT) as connector:
            region = KVRegion.from_buffer(kv)
            connector.register(region)
            peer = connector.add_peer(conn.recv())
            rng = np.random.default_rng(1)
            even = np.arange(0, NUM_BLOCKS, 2)
            cases = {
                "64 MiB region": lambda: (list(range(2048)), list(range(2048, 4096))),
                "1000 x 32 KiB scattered": lambda: (rng.choice(even, 1000, replace=False).tolist(),
                                                    rng.choice(even, 1000, replace=False).tolist()),
            }
            for name, make_ids in cases.items():
                remote_ids, local_ids = make_ids()
                time_read(connector, peer, remote_ids, local_ids)  # warm-up
                conn.send(remote_ids)  # check the bytes landed, once
                if conn.recv() != kv_checksum(region, local_ids):
                    raise RuntimeError(f"{backend} {name}: checksum mismatch")
                seconds = []
                for _ in range(repeats):
                    remote_ids, local_ids = make_ids()
                    elapsed, num_descriptors = time_read(connector, peer, remote_ids, local_ids)
                    seconds.append(elapsed)
                num_bytes = len(remote_ids) * BLOCK_BYTES
                results.append({"backend": backend, "case": name, "bytes": num_bytes, "descriptors": num_descriptors,
                                "median_gb_s": num_bytes / statistics.median(seconds) / 1e9,
                                "best_gb_s": num_bytes / min(seconds) / 1e9,
                                "median_ms": statistics.median(seconds) * 1e3})
    finally:
        if server.is_alive():
            conn.send(None)
            server.join(30)
        if server.is_alive():
            server.kill()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=[*BACKENDS, "all"], default="all")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    backends = BACKENDS if args.backend == "all" else (args.backend,)
    results = [row for backend in backends for row in bench_backend(backend, args.repeats)]
    print(f"{'backend':<10}{'case':<26}{'descriptors':>12}{'median GB/s':>13}{'best GB/s':>11}{'median ms':>11}")
    for row in results:
        print(f"{row['backend']:<10}{row['case']:<26}{row['descriptors']:>12}{row['median_gb_s']:>13.2f}"
              f"{row['best_gb_s']:>11.2f}{row['median_ms']:>11.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
