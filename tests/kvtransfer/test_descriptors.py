"""Block ids → the fewest contiguous descriptors (kvtransfer.descriptors)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtransfer.descriptors import BlockRun, coalesce_runs, validate_block_ids
from kvtransfer.errors import InvalidDescriptorError


def test_consecutive_ids_on_both_sides_make_one_run() -> None:
    assert coalesce_runs([4, 5, 6, 7], [10, 11, 12, 13]).to_list() == [BlockRun(4, 10, 4)]


def test_a_run_breaks_where_either_side_jumps() -> None:
    assert coalesce_runs([1, 2, 3, 4], [5, 6, 9, 10]).to_list() == [BlockRun(1, 5, 2), BlockRun(3, 9, 2)]
    assert coalesce_runs([1, 2, 5, 6], [7, 8, 9, 10]).to_list() == [BlockRun(1, 7, 2), BlockRun(5, 9, 2)]


def test_order_of_the_pairs_does_not_matter() -> None:
    assert coalesce_runs([12, 10, 11], [22, 20, 21]).to_list() == [BlockRun(10, 20, 3)]


def test_scattered_ids_stay_one_run_each_ordered_by_remote_block() -> None:
    assert coalesce_runs([9, 1, 5], [0, 7, 3]).to_list() == [BlockRun(1, 7, 1), BlockRun(5, 3, 1), BlockRun(9, 0, 1)]


def test_a_remote_block_read_into_several_local_blocks_joins_the_right_runs() -> None:
    # (1→5, 2→6) is one run, (1→9) another: grouping by diagonal finds it where a plain sort would not
    assert coalesce_runs([1, 1, 2], [5, 9, 6]).to_list() == [BlockRun(1, 5, 2), BlockRun(1, 9, 1)]


def test_empty_read_has_no_runs() -> None:
    runs = coalesce_runs([], [])
    assert len(runs) == 0 and runs.to_list() == []
    remote, local = runs.block_indices()
    assert remote.size == local.size == 0
    assert runs.byte_ranges(remote_base=0, local_base=0, block_bytes=8) == ([], [], [])


def test_runs_cover_exactly_the_requested_copies() -> None:
    rng = np.random.default_rng(0)
    remote = rng.integers(0, 50, 200)
    local = rng.permutation(300)[:200]
    runs = coalesce_runs(remote, local)
    remote_indices, local_indices = runs.block_indices()
    assert sorted(zip(remote_indices.tolist(), local_indices.tolist(), strict=True)) == \
        sorted(zip(remote.tolist(), local.tolist(), strict=True))


def test_run_indices_and_byte_ranges() -> None:
    runs = coalesce_runs([2, 3, 7], [0, 1, 5])
    assert runs.to_list() == [BlockRun(2, 0, 2), BlockRun(7, 5, 1)]
    remote, local = runs.block_indices()
    assert remote.tolist() == [2, 3, 7] and local.tolist() == [0, 1, 5]
    assert runs.byte_ranges(remote_base=1000, local_base=5000, block_bytes=10) == ([5000, 5050], [1020, 1070], [20, 10])


def test_validate_accepts_lists_tuples_and_int_arrays() -> None:
    remote, local = validate_block_ids((0, 1), np.array([3, 2], dtype=np.int32), num_remote_blocks=2,
                                       num_local_blocks=4)
    assert remote.dtype == local.dtype == np.int64
    assert remote.tolist() == [0, 1] and local.tolist() == [3, 2]


@pytest.mark.parametrize(("remote", "local", "message"), [
    ([0, 1], [0], "2 remote block ids but 1 local"),
    ([4], [0], "remote block id 4 is out of range: the remote region has 4 blocks"),
    ([0], [8], "local block id 8 is out of range: the local region has 8 blocks"),
    ([-1], [0], "remote block id -1"),
    ([0, 1], [3, 3], "local block 3 is named more than once"),
    ([0.0], [1], "flat sequence of ints"),
    ([True], [1], "flat sequence of ints"),
    ([[0, 1]], [[1, 2]], "flat sequence of ints"),
    ("01", [0, 1], "sequence of ints"),
    ([0, "1"], [0, 1], "flat sequence of ints"),
])
def test_validate_rejects_bad_ids_with_a_clear_message(remote: object, local: object, message: str) -> None:
    with pytest.raises(InvalidDescriptorError, match=message):
        validate_block_ids(remote, local, num_remote_blocks=4, num_local_blocks=8)  # type: ignore[arg-type]


def test_the_number_of_runs_is_the_fewest_possible() -> None:
    # a copy starts a run exactly when the copy one block before it on both sides is not requested
    rng = np.random.default_rng(5)
    for _ in range(20):
        local = rng.permutation(64)[:40]
        remote = rng.integers(0, 16, 40)
        copies = set(zip(remote.tolist(), local.tolist(), strict=True))
        fewest = sum((r - 1, loc - 1) not in copies for r, loc in copies)
        assert len(coalesce_runs(remote, local)) == fewest
