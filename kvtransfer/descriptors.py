"""Block ids → as few contiguous transfer descriptors as possible. Pure functions; no transfer library here.

A READ is a set of independent copies `remote block r[k] → local block l[k]`, so their order is free. Two
copies belong to one descriptor when both sides advance by one block: (r, l) and (r + 1, l + 1). Grouping
copies by their diagonal `l - r` and sorting by `r` makes every maximal run of consecutive `r` in a group one
descriptor, which is the fewest possible (local ids are unique, so each diagonal holds each `r` at most once).

    remote  3 4 5   9 10      →  runs (3→7, 3 blocks), (9→0, 2 blocks)
    local   7 8 9   0  1
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvtransfer.errors import InvalidDescriptorError

BlockIds = Sequence[int] | np.ndarray


class BlockRun(NamedTuple):
    """`num_blocks` consecutive blocks from remote block `remote_start` into local block `local_start`."""

    remote_start: int
    local_start: int
    num_blocks: int


@dataclass(frozen=True, eq=False)
class BlockRuns:
    """Runs as three aligned int64 arrays (vectorised: a read of thousands of blocks costs microseconds)."""

    remote_starts: np.ndarray
    local_starts: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return int(self.lengths.size)

    def to_list(self) -> list[BlockRun]:
        return [BlockRun(int(r), int(loc), int(n))
                for r, loc, n in zip(self.remote_starts, self.local_starts, self.lengths, strict=True)]

    def block_indices(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-block (remote, local) indices in run order, for libraries that take indices into per-block
        descriptor lists and merge adjacent entries themselves (NIXL's prepared lists)."""
        first_of_run = np.repeat(np.cumsum(self.lengths) - self.lengths, self.lengths)
        within_run = np.arange(int(self.lengths.sum()), dtype=np.int64) - first_of_run
        return (np.repeat(self.remote_starts, self.lengths) + within_run,
                np.repeat(self.local_starts, self.lengths) + within_run)

    def byte_ranges(self, *, remote_base: int, local_base: int,
                    block_bytes: int) -> tuple[list[int], list[int], list[int]]:
        """(local addresses, remote addresses, lengths) as Python ints: one contiguous byte range per run."""
        return ([local_base + int(start) * block_bytes for start in self.local_starts],
                [remote_base + int(start) * block_bytes for start in self.remote_starts],
                (self.lengths * block_bytes).tolist())


def _as_id_array(block_ids: BlockIds, side: str) -> np.ndarray:
    if isinstance(block_ids, (str, bytes)):
        raise InvalidDescriptorError(f"{side} block ids must be a sequence of ints, got {type(block_ids).__name__}")
    try:
        ids = np.asarray(block_ids)
    except (TypeError, ValueError) as e:
        raise InvalidDescriptorError(f"{side} block ids must be a sequence of ints: {e}") from None
    if ids.size == 0:
        return np.zeros(0, dtype=np.int64)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise InvalidDescriptorError(f"{side} block ids must be a flat sequence of ints, got dtype {ids.dtype} "
                                     f"and shape {ids.shape}")
    return ids.astype(np.int64, copy=False)


def validate_block_ids(remote_block_ids: BlockIds, local_block_ids: BlockIds, *, num_remote_blocks: int,
                       num_local_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Checks a READ's block ids against both regions; returns them as int64 arrays.

    Raises InvalidDescriptorError when the lists differ in length, an id is out of `[0, num_blocks)`, or a local
    block is named twice (two sources for one destination). A remote block may be read into several local ones.
    """
    remote = _as_id_array(remote_block_ids, "remote")
    local = _as_id_array(local_block_ids, "local")
    if remote.shape != local.shape:
        raise InvalidDescriptorError(f"{remote.size} remote block ids but {local.size} local block ids")
    for side, ids, num_blocks in (("remote", remote, num_remote_blocks), ("local", local, num_local_blocks)):
        if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
            bad = int(ids[(ids < 0) | (ids >= num_blocks)][0])
            raise InvalidDescriptorError(f"{side} block id {bad} is out of range: the {side} region has "
                                         f"{num_blocks} blocks")
    ordered = np.sort(local)  # a sort and a compare: a read's ids are validated on the handoff's critical path
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    if repeated.size:
        raise InvalidDescriptorError(f"local block {int(repeated[0])} is named more than once")
    return remote, local


def coalesce_runs(remote_block_ids: BlockIds, local_block_ids: BlockIds) -> BlockRuns:
    """The fewest runs covering the copies `remote[k] → local[k]`, ordered by remote block (ids must already be
    valid: see validate_block_ids)."""
    remote = np.asarray(remote_block_ids, dtype=np.int64)
    local = np.asarray(local_block_ids, dtype=np.int64)
    if not remote.size:
        empty = np.zeros(0, dtype=np.int64)
        return BlockRuns(empty, empty, empty)
    # Sorting by (diagonal, remote id) and then runs by (remote, local) start, each as one int64 key (unique:
    # local ids are), costs a third of two lexsorts.
    num_remote, num_local = int(remote.max()) + 1, int(local.max()) + 1
    diagonal = local - remote
    order = np.argsort((diagonal + num_remote) * num_remote + remote)
    remote, diagonal = remote[order], diagonal[order]
    breaks = np.flatnonzero((np.diff(diagonal) != 0) | (np.diff(remote) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [remote.size]))).astype(np.int64)
    remote_starts, local_starts = remote[starts], remote[starts] + diagonal[starts]
    by_remote = np.argsort(remote_starts * num_local + local_starts)
    return BlockRuns(remote_starts[by_remote], local_starts[by_remote], lengths[by_remote])
