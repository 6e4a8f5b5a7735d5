"""KV transfer throughput over the kvtransfer connectors: two processes on one machine.

    python bench/kv_transfer.py [--backend nixl|mooncake|ipc|all] [--device cpu|cuda] [--repeats 7] [--json FILE]

For each backend a "prefill" process registers its region and keeps its connector making progress; this
("decode") process registers its own region and READs from it:
- host memory (`--device cpu`): 128 MiB regions of 32 KiB blocks; one 64 MiB region (2048 consecutive blocks,
  one descriptor), and 1,000 scattered 32 KiB blocks (ids drawn from even block numbers on both sides, so
  nothing coalesces: 1,000 descriptors);
- GPU memory (`--device cuda`, both pools on GPU 0): 2 GiB regions of 2 MiB blocks; one 1 GiB region (512
  consecutive blocks), and 256 scattered 2 MiB blocks (256 descriptors).
Each read is timed from `read()` until `poll()` says DONE; prints the median and best GB/s (1 GB = 1e9 bytes).
The first read of each case is a warm-up (connection set-up, page faults, mapping) and is not counted.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

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

LAYOUT = KVLayout(model="bench", dtype="bfloat16", num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
                  tp_size=1)


@dataclass(frozen=True)
class Geometry:
    block_bytes: int
    num_blocks: int
    region_blocks: int  # the "one region" case reads this many consecutive blocks
    scattered_blocks: int


GEOMETRIES = {"cpu": Geometry(32 << 10, 4096, 2048, 1000), "cuda": Geometry(2 << 20, 1024, 512, 256)}


def make_pool(device: str, geometry: Geometry, fill: int | None) -> Any:
    """A [num_blocks, block_bytes] uint8 pool: random bytes (fill None) or `fill` everywhere (touched, so no page
    faults inside timings)."""
    shape = (geometry.num_blocks, geometry.block_bytes)
    if device == "cpu":
        if fill is None:
            return np.random.default_rng(0).integers(0, 256, size=shape, dtype=np.uint8)
        return np.full(shape, fill, dtype=np.uint8)
    import torch

    if fill is None:
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device)
    return torch.full(shape, fill, dtype=torch.uint8, device=device)


def serve(conn: Connection, backend: str, device: str) -> None:
    """The prefill side: owns the blocks being read; makes progress until told to stop."""
    kv = make_pool(device, GEOMETRIES[device], None)
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


def bench_backend(backend: str, device: str, repeats: int) -> list[dict[str, object]]:
    geometry = GEOMETRIES[device]
    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    server = context.Process(target=serve, args=(child_conn, backend, device), daemon=True)
    server.start()
    kv = make_pool(device, geometry, 7)
    results = []
    try:
        if not conn.poll(60):
            raise RuntimeError(f"the {backend} prefill process did not start")
        with make_connector(backend, layout=LAYOUT) as connector:
            region = KVRegion.from_buffer(kv)
            connector.register(region)
            peer = connector.add_peer(conn.recv())
            rng = np.random.default_rng(1)
            even = np.arange(0, geometry.num_blocks, 2)
            region_blocks, scattered = geometry.region_blocks, geometry.scattered_blocks
            cases = {
                f"{region_blocks * geometry.block_bytes >> 20} MiB region":
                    lambda: (list(range(region_blocks)), list(range(region_blocks, 2 * region_blocks))),
                f"{scattered} x {geometry.block_bytes >> 10} KiB scattered":
                    lambda: (rng.choice(even, scattered, replace=False).tolist(),
                             rng.choice(even, scattered, replace=False).tolist()),
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
                num_bytes = len(remote_ids) * geometry.block_bytes
                results.append({"backend": backend, "device": device, "case": name, "bytes": num_bytes,
                                "descriptors": num_descriptors,
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
    parser.add_argument("--device", choices=sorted(GEOMETRIES), default="cpu",
                        help="where both KV pools live (cuda: GPU 0)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    backends = BACKENDS if args.backend == "all" else (args.backend,)
    results = [row for backend in backends for row in bench_backend(backend, args.device, args.repeats)]
    print(f"{'backend':<10}{'case':<28}{'descriptors':>12}{'median GB/s':>13}{'best GB/s':>11}{'median ms':>11}")
    for row in results:
        print(f"{row['backend']:<10}{row['case']:<28}{row['descriptors']:>12}{row['median_gb_s']:>13.2f}"
              f"{row['best_gb_s']:>11.2f}{row['median_ms']:>11.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
