"""The block-copy kernel of the ipc backend (kvtransfer/gpu_copy.py), run by Triton's interpreter on CPU tensors
(on a GPU the same tests compile it); numpy indexing is the oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtransfer.gpu_copy import copy_blocks, word_view


def _pool(num_blocks: int, block_bytes: int, seed: int, offset: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    raw = torch.from_numpy(rng.integers(0, 256, size=num_blocks * block_bytes + offset, dtype=np.uint8))
    return raw[offset:].view(num_blocks, block_bytes)


@pytest.mark.parametrize(("block_bytes", "offset", "word_dtype"), [
    (64, 0, torch.int64),  # the usual case: 8-byte words
    (6, 0, torch.int16),  # a block size that only 2-byte words divide
    (64, 4, torch.int32),  # a pool that starts 4 bytes into its allocation
    (40960, 0, torch.int64),  # more than one chunk per block, the last one partial
    (16384 * 5 + 8, 0, torch.int64),  # two programs per block, the second with partial and empty chunks
])
def test_every_named_block_lands_and_no_other_block_changes(block_bytes: int, offset: int,
                                                            word_dtype: torch.dtype) -> None:
    source = _pool(12, block_bytes, seed=1)
    destination = _pool(15, block_bytes, seed=2, offset=offset)
    assert word_view(destination).dtype == word_dtype
    source_ids, destination_ids = [3, 4, 5, 11, 0, 3], [14, 0, 1, 7, 8, 2]  # runs, a lone block, a block twice
    expected = destination.numpy().copy()
    expected[destination_ids] = source.numpy()[source_ids]
    copy_blocks(destination, source, torch.tensor(destination_ids), torch.tensor(source_ids))
    np.testing.assert_array_equal(destination.numpy(), expected)


def test_no_ids_copy_nothing() -> None:
    source, destination = _pool(2, 64, seed=1), _pool(2, 64, seed=2)
    before = destination.clone()
    copy_blocks(destination, source, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    assert torch.equal(destination, before)
