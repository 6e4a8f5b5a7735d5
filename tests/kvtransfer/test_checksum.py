"""The checksum of KV blocks' bytes (kvtransfer.checksum): what a prefill node puts in a ticket, one per block,
and what a decode node checks each block it pulled against (with the algorithm the ticket names).
mix64's formula and kernels: test_gpu_checksum.py."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import torch
import xxhash

from kvtransfer.base import KVRegion, MemoryKind
from kvtransfer.checksum import (
    CHECKSUM_ALGORITHMS,
    checksum_algorithm,
    default_checksum_algorithm,
    kv_block_checksums,
    kv_checksum,
    mismatched_blocks,
)
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


def gpu_kind_region(kv: torch.Tensor) -> KVRegion:
    """A region that says VRAM over a CPU tensor: the GPU code paths that go through the owning tensor (the
    compiled kernel itself is checked on CUDA in test_gpu_checksum.py)."""
    return KVRegion(kv.data_ptr(), kv.shape[0], kv[0].nbytes, MemoryKind.VRAM, owner=kv)


def test_default_algorithms_are_xxh3_on_the_host_and_mix64_on_the_gpu() -> None:
    kv = torch.zeros((4, 64), dtype=torch.float16)
    assert default_checksum_algorithm(region_of(kv.numpy())) == "xxh3-128"
    assert default_checksum_algorithm(gpu_kind_region(kv)) == "mix64"
    assert kv_block_checksums(region_of(kv.numpy()), [1])[0].startswith("xxh3-128:")
    assert kv_block_checksums(gpu_kind_region(kv), [1])[0].startswith("mix64:")
    assert kv_checksum(gpu_kind_region(kv), [1, 2]).startswith("mix64:")


@pytest.mark.parametrize("algorithm", CHECKSUM_ALGORITHMS)
@pytest.mark.parametrize("kind", ["host", "gpu"])
def test_the_batch_equals_one_checksum_per_block_on_both_memory_kinds(algorithm: str, kind: str) -> None:
    kv = torch.from_numpy(np.random.default_rng(5).integers(0, 256, size=(12, 512), dtype=np.uint8))
    region = region_of(kv.numpy()) if kind == "host" else gpu_kind_region(kv)
    block_ids = [7, 0, 11, 7, 3]
    batch = kv_block_checksums(region, block_ids, algorithm)
    assert batch == [kv_checksum(region, [b], algorithm) for b in block_ids]
    assert len(set(batch)) == 4 and batch[0] == batch[3]
    # and the same bytes give the same checksums in the other memory kind
    other = gpu_kind_region(kv) if kind == "host" else region_of(kv.numpy())
    assert kv_block_checksums(other, block_ids, algorithm) == batch


def test_the_xxh3_batch_is_the_documented_hash_of_each_block_alone() -> None:
    kv = np.random.default_rng(6).integers(0, 256, size=(3, 128), dtype=np.uint8)
    expected = [f"xxh3-128:{xxhash.xxh3_128(struct.pack('<QQ', 1, 128) + kv[b].tobytes()).hexdigest()}"
                for b in (2, 0)]
    assert kv_block_checksums(region_of(kv), [2, 0], "xxh3-128") == expected
    assert kv_block_checksums(gpu_kind_region(torch.from_numpy(kv)), [2, 0], "xxh3-128") == expected


def test_a_decode_node_verifies_with_the_algorithm_the_ticket_names() -> None:
    source = np.random.default_rng(7).integers(0, 256, size=(8, 256), dtype=np.uint8)
    gpu_p = gpu_kind_region(torch.from_numpy(source))
    cpu_p = region_of(source)
    destination = np.zeros_like(source)
    destination[[5, 1, 2]] = source[[0, 3, 4]]
    cpu_d = region_of(destination)
    gpu_d = gpu_kind_region(torch.from_numpy(destination))
    for p in (gpu_p, cpu_p):  # a GPU P (mix64) or a CPU P (xxh3), each verified by a CPU D and a GPU D
        ticket = kv_block_checksums(p, [0, 3, 4])
        for d in (cpu_d, gpu_d):
            assert mismatched_blocks(d, [5, 1, 2], ticket) == []
            destination[1, 100] ^= 0x04
            assert mismatched_blocks(d, [5, 1, 2], ticket) == [1]
            destination[1, 100] ^= 0x04
    # one ticket may even mix algorithms: each block is checked with its own
    mixed = [kv_checksum(gpu_p, [0]), kv_checksum(cpu_p, [3]), kv_checksum(cpu_p, [4], "blake2b-128")]
    assert [c.split(":")[0] for c in mixed] == ["mix64", "xxh3-128", "blake2b-128"]
    destination[2, 0] ^= 0x80
    assert mismatched_blocks(cpu_d, [5, 1, 2], mixed) == [2]


def test_checksums_naming_no_known_algorithm_are_refused_clearly() -> None:
    region = region_of(np.zeros((4, 64), dtype=np.uint8))
    assert checksum_algorithm("mix64:00ff") == "mix64"
    for checksum in ["md5:abcd", "mix64", "mix64:", "", "xxh3-128"]:
        with pytest.raises(InvalidRequestError, match="names no known algorithm"):
            mismatched_blocks(region, [0], [checksum])
    with pytest.raises(InvalidRequestError, match="2 checksums for 1 blocks"):
        mismatched_blocks(region, [0], ["mix64:00", "mix64:00"])
    with pytest.raises(InvalidRequestError, match="unknown checksum algorithm"):
        kv_block_checksums(region, [0], "md5")
    with pytest.raises(InvalidDescriptorError, match="block ids"):
        kv_block_checksums(region, [0, 4], "mix64")
