"""Where the ipc handoff's time goes on a GPU: block-copy kernel variants against a plain copy, the pieces of one
read through the connector, and the mix64 checksum's cost. One process; prints JSON lines.

    python3 bench/h200/ipc_probe.py [--variants] > probe.jsonl     # --variants: the kernel sweep (2 minutes)
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kvtransfer.gpu_copy import _copy_blocks  # noqa: E402 - the kernel itself, launched with each variant's sizes

BLOCK_BYTES = 32 * 2 * 8 * 128 * 16 * 2  # 8B shape: 32 layers, K and V, 8 heads of 128, 16 tokens, bf16 = 2 MiB
NUM_BLOCKS = 2048 + 64


def emit(**row: object) -> None:
    print(json.dumps(row), flush=True)


def kernel_copy(destination, source, destination_ids, source_ids, dtype, chunk_bytes, warps, per_program):
    d, s = destination.view(dtype), source.view(dtype)
    block_words = d.shape[1]
    chunk_words = chunk_bytes // dtype.itemsize
    grid = (destination_ids.numel(), triton.cdiv(block_words, chunk_words * per_program))
    _copy_blocks[grid](s, d, source_ids, destination_ids, block_words, CHUNK_WORDS=chunk_words,
                       CHUNKS_PER_PROGRAM=per_program, num_warps=warps)


def timed(fn, repeats=20, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def scattered_ids(num_blocks: int, seed: int) -> np.ndarray:
    """num_blocks ids from the pool, in shuffled runs of 1-4 (a free list after churn)."""
    rng = np.random.default_rng(seed)
    runs, start = [], 0
    while start < NUM_BLOCKS:
        length = int(rng.integers(1, 5))
        runs.append(list(range(start, min(start + length, NUM_BLOCKS))))
        start += length
    rng.shuffle(runs)
    return np.array([b for run in runs for b in run][:num_blocks], dtype=np.int64)


def kernels(source, destination, variants: bool) -> None:
    from kvtransfer.gpu_copy import copy_blocks

    for tokens in (1024, 4096, 16384):
        blocks = tokens // 16
        nbytes = blocks * BLOCK_BYTES
        base = timed(functools.partial(lambda n: destination[:n].copy_(source[:n]), blocks))
        emit(kind="copy", tokens=tokens, ms=base, gbps=nbytes / base / 1e6)
        for layout, seed in (("contiguous", None), ("scattered", 1)):
            src = np.arange(blocks) if seed is None else scattered_ids(blocks, seed)
            dst = np.arange(blocks) if seed is None else scattered_ids(blocks, seed + 1)
            s_ids, d_ids = (torch.from_numpy(a).cuda() for a in (src, dst))
            ms = timed(functools.partial(copy_blocks, destination, source, d_ids, s_ids))
            emit(kind="current", tokens=tokens, layout=layout, ms=ms, gbps=nbytes / ms / 1e6, x_copy=base / ms)
            ms = timed(functools.partial(lambda d, s: destination.index_copy_(0, d, source.index_select(0, s)), d_ids,
                                            s_ids))
            emit(kind="index_copy", tokens=tokens, layout=layout, ms=ms, gbps=nbytes / ms / 1e6, x_copy=base / ms)
            for dtype in (torch.int64, torch.int32) if variants else ():
                for chunk in (8192, 16384, 32768, 65536):
                    for warps in (4, 8, 16):
                        for per in (1, 4):
                            if chunk * per > BLOCK_BYTES:
                                continue
                            try:
                                ms = timed(functools.partial(kernel_copy, destination, source, d_ids, s_ids, dtype,
                                                             chunk, warps, per), repeats=10, warmup=2)
                            except Exception as e:  # noqa: BLE001 - a variant that does not compile is a row
                                emit(kind="variant", error=str(e)[:200], dtype=str(dtype), chunk=chunk, warps=warps)
                                continue
                            emit(kind="variant", tokens=tokens, layout=layout, dtype=str(dtype), chunk=chunk,
                                 warps=warps, per_program=per, ms=ms, gbps=nbytes / ms / 1e6, x_copy=base / ms)
            assert torch.equal(destination[d_ids], source[s_ids])


def connector_pair():
    """Two ipc connectors of this process over two GPU pools; the second has the first as its peer."""
    from kvtransfer import KVLayout, KVRegion, make_connector

    layout = KVLayout(model="probe", dtype="bfloat16", num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
                      tp_size=1)
    pools = [torch.randint(0, 255, (NUM_BLOCKS, BLOCK_BYTES), dtype=torch.uint8, device="cuda") for _ in range(2)]
    prefill, decode = (make_connector("ipc", layout=layout) for _ in range(2))
    metadata = prefill.register(KVRegion.from_buffer(pools[0]))
    decode.register(KVRegion.from_buffer(pools[1]))
    return pools, prefill, decode, decode.add_peer(metadata)


def read_pieces() -> None:
    """Two ipc connectors in this process (the second reads the first's pool through its tensor)."""
    from kvtransfer import KVRegion, TransferStatus
    from kvtransfer.checksum import kv_block_checksums
    from kvtransfer.descriptors import coalesce_runs

    pools, prefill, decode, peer = connector_pair()
    region = KVRegion.from_buffer(pools[1])
    for tokens in (1024, 4096, 16384):
        blocks = tokens // 16
        remote, local = scattered_ids(blocks, 5), scattered_ids(blocks, 6)
        walls, reads, runs_s, ids_s = [], [], [], []
        for repeat in range(12):
            torch.cuda.synchronize()
            start = time.perf_counter()
            handle = decode.read(peer, remote, local)
            issued = time.perf_counter()
            polls = 0
            while decode.poll(handle) is TransferStatus.PENDING:
                polls += 1
            done = time.perf_counter()
            if repeat >= 2:
                walls.append((done - start) * 1e3)
                reads.append((issued - start) * 1e3)
            t0 = time.perf_counter()
            runs = coalesce_runs(remote, local)
            t1 = time.perf_counter()
            r, l_ = runs.block_indices()
            torch.from_numpy(np.stack((l_, r))).to("cuda", non_blocking=True)
            t2 = time.perf_counter()
            runs_s.append((t1 - t0) * 1e3)
            ids_s.append((t2 - t1) * 1e3)
        emit(kind="read", tokens=tokens, wall_ms=statistics.median(walls), read_call_ms=statistics.median(reads),
             coalesce_ms=statistics.median(runs_s), ids_to_gpu_ms=statistics.median(ids_s), polls=polls)
        checks = []
        for _ in range(8):
            torch.cuda.synchronize()
            start = time.perf_counter()
            kv_block_checksums(region, local.tolist())
            checks.append((time.perf_counter() - start) * 1e3)
        emit(kind="checksum", tokens=tokens, blocks=blocks, ms=statistics.median(checks[2:]),
             gbps=blocks * BLOCK_BYTES / statistics.median(checks[2:]) / 1e6)
    decode.close()
    prefill.close()


def profile_reads() -> None:
    """cProfile of 30 reads of 4k tokens (scattered) through the connector: where the host time of a read goes."""
    import cProfile
    import io
    import pstats

    from kvtransfer import TransferStatus

    pools, prefill, decode, peer = connector_pair()
    remote, local = scattered_ids(256, 5), scattered_ids(256, 6)
    for _ in range(3):
        decode.wait(decode.read(peer, remote, local))
    profiler = cProfile.Profile()
    for _ in range(30):
        torch.cuda.synchronize()
        profiler.enable()
        handle = decode.read(peer, remote, local)
        profiler.disable()
        while decode.poll(handle) is TransferStatus.PENDING:
            pass
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
    print(out.getvalue(), file=sys.stderr)
    decode.close()
    prefill.close()


def main() -> None:
    torch.cuda.set_device(0)
    if "--profile" in sys.argv:
        profile_reads()
        return
    source = torch.randint(0, 255, (NUM_BLOCKS, BLOCK_BYTES), dtype=torch.uint8, device="cuda")
    destination = torch.zeros_like(source)
    read_pieces()
    kernels(source, destination, variants="--variants" in sys.argv)


if __name__ == "__main__":
    main()
