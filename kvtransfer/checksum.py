"""The checksum of KV blocks' bytes: how a decode node knows the blocks it pulled are the ones P pinned.

P issues a ticket with one checksum per block (`kv_block_checksums(region, block_ids)`: one call per ticket);
D, after pulling some of those blocks into its own ids, checks the pulled ones (`mismatched_blocks`; it skips
the blocks its own prefix cache already held). A mismatch is a failed transfer, never a success. A checksum
covers the blocks' bytes in the order given (not their ids, which differ on the two sides), and names its
algorithm: `"<algorithm>:<hex>"`, one of
- `"xxh3-128"` (xxhash, about 15 GB/s on one core here): the default for host (DRAM) pools;
- `"blake2b-128"` (stdlib fallback, about 0.9 GB/s);
- `"mix64"` (kvtransfer/gpu_checksum.py): the default for GPU (VRAM) pools, all blocks of a ticket in one
  launch on the GPU instead of a host copy per block.
Every algorithm works on both memory kinds (the host ones copy GPU blocks to the host; mix64 runs a torch
twin on host blocks), and D verifies with the algorithm each checksum names: a CPU node and a GPU node pair.
"""

from __future__ import annotations

import ctypes
import hashlib
import struct
from collections.abc import Iterator, Sequence
from typing import Any

from kvtransfer.base import KVRegion, MemoryKind
from kvtransfer.errors import InvalidDescriptorError, InvalidRequestError

xxhash: Any
try:
    import xxhash
except ImportError:  # pragma: no cover - xxhash is a dependency; the fallback keeps checksums working without it
    xxhash = None

MIX64 = "mix64"  # computed by kvtransfer/gpu_checksum.py, imported only when used
CHECKSUM_ALGORITHMS = ("xxh3-128", "blake2b-128", MIX64)
DEFAULT_CHECKSUM_ALGORITHM = "xxh3-128" if xxhash is not None else "blake2b-128"  # for host pools
HOST_COPY_BYTES = 256 << 20  # a host algorithm on GPU blocks copies at most this much to the host at a time


def default_checksum_algorithm(region: KVRegion) -> str:
    """mix64 for GPU pools (no host round trip), xxh3-128 (or its fallback) for host pools."""
    return MIX64 if region.memory_kind is MemoryKind.VRAM else DEFAULT_CHECKSUM_ALGORITHM


def checksum_algorithm(checksum: str) -> str:
    """The algorithm a checksum string names; `InvalidRequestError` when it names none this node knows."""
    algorithm, separator, digest = checksum.partition(":")
    if not separator or not digest or algorithm not in CHECKSUM_ALGORITHMS:
        raise InvalidRequestError(f"checksum {checksum[:48]!r} names no known algorithm "
                                  f"(known: {', '.join(CHECKSUM_ALGORITHMS)})")
    return algorithm


def kv_checksum(region: KVRegion, block_ids: Sequence[int], algorithm: str | None = None) -> str:
    """One checksum of the bytes of `block_ids` (in that order) in `region`; detects any flipped byte.

    `algorithm` defaults to the region's (`default_checksum_algorithm`). For xxh3-128 and blake2b-128 the
    hashed message is `struct.pack("<QQ", len(block_ids), region.block_bytes)` followed by the blocks' bytes
    in order; mix64 covers the blocks' concatenation (kvtransfer/gpu_checksum.py). The result is
    `f"{algorithm}:{hexdigest}"`."""
    algorithm = algorithm or default_checksum_algorithm(region)
    ids = _checked_ids(region, block_ids)
    if algorithm == MIX64:
        from kvtransfer.gpu_checksum import MASK64, mix64_block_sums, pool_words

        return _mix64_string(sum(mix64_block_sums(pool_words(region), ids, concatenated=True)) & MASK64)
    hasher = _new_hasher(algorithm)
    hasher.update(struct.pack("<QQ", len(ids), region.block_bytes))
    for first_block, num_blocks in _runs(ids):  # hash each run of consecutive ids in one call
        hasher.update(_blocks_view(region, first_block, num_blocks))
    return f"{algorithm}:{hasher.hexdigest()}"


def kv_block_checksums(region: KVRegion, block_ids: Sequence[int], algorithm: str | None = None) -> list[str]:
    """One checksum per block, `kv_checksum(region, [b], algorithm)` for each `b` of `block_ids`, in one batch.

    For mix64 on a GPU pool that is one kernel launch over all blocks and one device-to-host copy of
    `len(block_ids)` int64; a host algorithm on a GPU pool copies the blocks to the host in large batches."""
    algorithm = algorithm or default_checksum_algorithm(region)
    ids = _checked_ids(region, block_ids)
    if algorithm == MIX64:
        from kvtransfer.gpu_checksum import mix64_block_sums, pool_words

        return [_mix64_string(value) for value in mix64_block_sums(pool_words(region), ids)]
    _new_hasher(algorithm)  # an unknown algorithm fails before any copy
    header = struct.pack("<QQ", 1, region.block_bytes)
    checksums = []
    for block in _host_blocks(region, ids):
        hasher = _new_hasher(algorithm)
        hasher.update(header)
        hasher.update(block)
        checksums.append(f"{algorithm}:{hasher.hexdigest()}")
    return checksums


def block_checksum(data: bytes | memoryview, algorithm: str = DEFAULT_CHECKSUM_ALGORITHM) -> str:
    """The checksum of one block's bytes, without a region: exactly `kv_checksum(region, [b], algorithm)` for a
    region whose block `b` holds `data` (so `block_bytes == len(data)`). Host algorithms only (mix64 needs the
    pool's layout); for KV blocks that travel outside a handoff, e.g. through a shared store."""
    if algorithm == MIX64:
        raise InvalidRequestError("block_checksum supports the host algorithms only (xxh3-128, blake2b-128)")
    view = memoryview(data).cast("B")
    hasher = _new_hasher(algorithm)
    hasher.update(struct.pack("<QQ", 1, view.nbytes))
    hasher.update(view)
    return f"{algorithm}:{hasher.hexdigest()}"


def mismatched_blocks(region: KVRegion, block_ids: Sequence[int], expected: Sequence[str]) -> list[int]:
    """The blocks of `block_ids` whose bytes do not match their `expected` checksum (one per block), each
    recomputed with the algorithm its checksum names (one batch per algorithm; a ticket normally has one).

    Raises `InvalidRequestError` for a checksum naming no known algorithm: a peer that cannot be verified."""
    if len(block_ids) != len(expected):
        raise InvalidRequestError(f"{len(expected)} checksums for {len(block_ids)} blocks")
    positions_by_algorithm: dict[str, list[int]] = {}
    for position, checksum in enumerate(expected):
        positions_by_algorithm.setdefault(checksum_algorithm(checksum), []).append(position)
    bad_positions = []
    for algorithm, positions in positions_by_algorithm.items():
        actual = kv_block_checksums(region, [block_ids[p] for p in positions], algorithm)
        bad_positions += [p for p, checksum in zip(positions, actual, strict=True) if checksum != expected[p]]
    return [int(block_ids[p]) for p in sorted(bad_positions)]


def _mix64_string(value: int) -> str:
    return f"{MIX64}:{value:016x}"


def _checked_ids(region: KVRegion, block_ids: Sequence[int]) -> list[int]:
    ids = [int(b) for b in block_ids]
    if any(b < 0 or b >= region.num_blocks for b in ids):
        raise InvalidDescriptorError(f"checksum block ids must be in [0, {region.num_blocks})")
    return ids


def _runs(ids: list[int]) -> Iterator[tuple[int, int]]:
    """(first block, number of blocks) of each run of consecutive ids."""
    start = 0
    while start < len(ids):
        end = start + 1
        while end < len(ids) and ids[end] == ids[end - 1] + 1:
            end += 1
        yield ids[start], end - start
        start = end


def _new_hasher(algorithm: str) -> Any:
    if algorithm == "xxh3-128":
        if xxhash is None:
            raise InvalidRequestError("checksum algorithm xxh3-128 needs the xxhash package")
        return xxhash.xxh3_128()
    if algorithm == "blake2b-128":
        return hashlib.blake2b(digest_size=16)
    raise InvalidRequestError(f"unknown checksum algorithm {algorithm!r} (known: {', '.join(CHECKSUM_ALGORITHMS)})")


def _blocks_view(region: KVRegion, first_block: int, num_blocks: int) -> Any:
    """A zero-copy view of host blocks, or a host copy of GPU blocks (through the owning tensor)."""
    if region.memory_kind is MemoryKind.DRAM:
        array_type = ctypes.c_ubyte * (num_blocks * region.block_bytes)
        return memoryview(array_type.from_address(region.block_address(first_block)))
    return _gpu_blocks(region)[first_block:first_block + num_blocks].cpu().numpy()


def _host_blocks(region: KVRegion, ids: list[int]) -> Iterator[Any]:
    """Each block's bytes on the host, in order: views of host blocks; GPU blocks gathered and copied to the
    host at most HOST_COPY_BYTES at a time (one copy per batch, not per block)."""
    if region.memory_kind is MemoryKind.DRAM:
        for block_id in ids:
            yield _blocks_view(region, block_id, 1)
        return
    import torch  # only GPU regions get here, and they are torch tensors

    blocks = _gpu_blocks(region)
    batch = max(1, HOST_COPY_BYTES // region.block_bytes)
    for start in range(0, len(ids), batch):
        index = torch.tensor(ids[start:start + batch], dtype=torch.int64, device=blocks.device)
        yield from blocks.index_select(0, index).cpu().numpy()


def _gpu_blocks(region: KVRegion) -> Any:
    """A GPU region as bytes `[num_blocks, block_bytes]` through its owning tensor."""
    import torch

    if region.owner is None:
        raise InvalidRequestError("a checksum of GPU blocks needs the region's owning tensor")
    return region.owner.reshape(-1).view(torch.uint8).reshape(region.num_blocks, region.block_bytes)
