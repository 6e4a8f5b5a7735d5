"""The checksum of KV blocks' bytes (kvtransfer.checksum): what a prefill node puts in a ticket, one per block,
and what a decode node checks each block it pulled against."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from kvtransfer.base import KVRegion
from kvtransfer.checksum import CHECKSUM_ALGORITHMS, kv_checksum
from kvtransfer.errors import InvalidDescriptorError, InvalidRequestError


def region_of(array: np.ndarray) -> KVRegion:
    return KVRegion.from_buffer(array)


def test_checksum_is_the_documented_blake2b_of_count_size_and_bytes() -> None:
    kv = np.arange(4 * 64, dtype=np.uint32).astype(np.uint8).reshape(4, 64)
    expected = hashlib.blake2b(struct.pack("<QQ", 2, 64) + kv[2].tobytes() + kv[0].tobytes(), digest_size=16)
    assert kv_checksum(region_of(kv), [2, 0], "blake2b-128") == f"blake2b-128:{expected.hexdigest()}"


@pytest.mark.parametrize("algorithm", CHECKSUM_ALGORITHMS)
def test_per_block_checksums_catch_one_flipped_byte_in_exactly_that_block(algorithm: str) -> None:
    kv = np.random.default_rng(0).integers(0, 256, size=(16, 1024), dtype=np.uint8)
    region = region_of(kv)
    pulled = [3, 4, 5, 11]
    issued = [kv_checksum(region, [b], algorithm) for b in pulled]  # what P puts in the ticket
    assert all(c.startswith(algorithm + ":") for c in issued)

    def bad_blocks() -> list[int]:  # what D checks after a pull
        return [b for b, c in zip(pulled, issued, strict=True) if kv_checksum(region, [b], algorithm) != c]

    assert bad_blocks() == []
    for block, offset in [(3, 0), (4, 517), (11, 1023)]:
        kv[block, offset] ^= 0x01
        assert bad_blocks() == [block]
        kv[block, offset] ^= 0x01
    kv[6, 0] ^= 0xFF  # a block D did not pull (its own prefix hit, say) does not matter
    assert bad_blocks() == []


def test_checksum_follows_block_bytes_and_order_not_ids() -> None:
    source = np.random.default_rng(1).integers(0, 256, size=(8, 256), dtype=np.uint8)
    destination = np.zeros_like(source)
    destination[[6, 0, 1]] = source[[2, 3, 4]]
    assert kv_checksum(region_of(source), [2, 3, 4]) == kv_checksum(region_of(destination), [6, 0, 1])
    assert kv_checksum(region_of(source), [2, 3, 4]) != kv_checksum(region_of(source), [3, 2, 4])


def test_checksum_refuses_out_of_range_blocks_and_unknown_algorithms() -> None:
    region = region_of(np.zeros((4, 64), dtype=np.uint8))
    with pytest.raises(InvalidDescriptorError, match="block ids"):
        kv_checksum(region, [4])
    with pytest.raises(InvalidRequestError, match="unknown checksum algorithm"):
        kv_checksum(region, [0], "md5")
