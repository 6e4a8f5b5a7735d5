"""mix64 (kvtransfer/gpu_checksum.py): the torch twin and the Triton kernel against an independent numpy
implementation of the documented formula (uint64 arithmetic), and what the checksum must catch.

The Triton kernel runs interpreted on CPU tensors (TRITON_INTERPRET=1, tiny shapes) and, marked gpu, compiled on
CUDA for Llama-8B-shaped blocks (2 MiB: 32 layers x K/V x 16 tokens x 8 heads x 128 dims in bf16)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from kvtransfer.base import KVRegion
from kvtransfer.checksum import kv_block_checksums, kv_checksum, mismatched_blocks
from kvtransfer.errors import InvalidRequestError
from kvtransfer.gpu_checksum import mix64_block_sums, mix64_sums_torch, pool_words

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
interpreted = pytest.mark.skipif(not INTERPRETED, reason="CPU Triton runs need TRITON_INTERPRET=1")
compiled_on_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED,
                                      reason="needs a CUDA device and compiled (not interpreted) Triton")
U64 = np.uint64


def oracle(words: np.ndarray, block_ids: list[int], position_stride: int = 0) -> list[int]:
    """The module docstring's formula, written from it in numpy uint64 (wrapping) arithmetic."""
    w = np.ascontiguousarray(words).view(np.uint32).astype(U64)
    sums = []
    for k, block in enumerate(block_ids):
        x = ((np.arange(w.shape[1], dtype=U64) + U64(k * position_stride)) << U64(32)) | w[block]
        x ^= x >> U64(30)
        x *= U64(0xBF58476D1CE4E5B9)
        x ^= x >> U64(27)
        x *= U64(0x94D049BB133111EB)
        x ^= x >> U64(31)
        sums.append(int(x.sum(dtype=U64)))
    return sums


def python_mix64(words: list[int]) -> int:
    """The formula once more, in Python integers word by word: the oracle's own check on a tiny block."""
    total = 0
    for i, word in enumerate(words):
        x = (i << 32) | (word & 0xFFFFFFFF)
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
        total += x ^ (x >> 31)
    return total % 2**64


def random_words(num_blocks: int, block_words: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**32, size=(num_blocks, block_words), dtype=np.uint32)


def twin(words: np.ndarray, block_ids: list[int], position_stride: int = 0, chunk_words: int = 1 << 20) -> list[int]:
    sums = mix64_sums_torch(torch.from_numpy(words.view(np.int32)), torch.tensor(block_ids, dtype=torch.int64),
                            position_stride, chunk_words)
    return [v % 2**64 for v in sums.tolist()]


def triton_sums(words: torch.Tensor, block_ids: list[int], position_stride: int = 0, **sizes: int) -> list[int]:
    from kvtransfer.gpu_checksum_kernels import mix64_sums_triton

    ids = torch.tensor(block_ids, dtype=torch.int64, device=words.device)
    return [v % 2**64 for v in mix64_sums_triton(words, ids, position_stride, **sizes).cpu().tolist()]


def one_byte_flipped_pool(block_bytes: int, seed: int = 3) -> np.ndarray:
    """Block 0 is random; block 1 + 3 * b + k is block 0 with byte b xor-ed with (0x01, 0x80, 0xFF)[k]."""
    base = np.random.default_rng(seed).integers(0, 256, size=block_bytes, dtype=np.uint8)
    pool = np.tile(base, (1 + 3 * block_bytes, 1))
    for b in range(block_bytes):
        for k, flip in enumerate((0x01, 0x80, 0xFF)):
            pool[1 + 3 * b + k, b] ^= flip
    return pool


def test_the_numpy_oracle_is_the_formula_word_by_word() -> None:
    words = random_words(2, 9, seed=5)
    assert oracle(words, [1, 0]) == [python_mix64(words[1].tolist()), python_mix64(words[0].tolist())]
    assert oracle(np.zeros((1, 3), dtype=np.uint32), [0]) == [python_mix64([0, 0, 0])]


@pytest.mark.parametrize(("num_blocks", "block_words", "chunk_words"),
                         [(6, 256, 1 << 20), (6, 256, 100), (5, 1000, 64), (40, 7, 16), (3, 1, 5)])
def test_the_torch_twin_equals_the_oracle_however_it_chunks(num_blocks: int, block_words: int,
                                                             chunk_words: int) -> None:
    words = random_words(num_blocks, block_words)
    block_ids = [num_blocks - 1, 0, 2, 2, 1]
    block_ids = [b % num_blocks for b in block_ids]
    assert twin(words, block_ids, 0, chunk_words) == oracle(words, block_ids)
    assert twin(words, block_ids, block_words, chunk_words) == oracle(words, block_ids, block_words)


def test_the_twin_handles_words_and_positions_with_the_top_bit_set() -> None:
    words = np.array([[0, 0xFFFFFFFF, 0x80000000, 0x7FFFFFFF] * 16], dtype=np.uint32)
    assert twin(words, [0]) == oracle(words, [0]) == [python_mix64(words[0].tolist())]
    # the second block's positions start past 2^31: x's top bit, the int64 sign, is set before any mixing
    stride = 3_000_000_000
    assert twin(words, [0, 0, 0], stride) == oracle(words, [0, 0, 0], stride)


def test_block_checksum_strings_of_a_host_pool_follow_the_formula() -> None:
    kv = np.random.default_rng(2).standard_normal((8, 2, 4, 16), dtype=np.float32)  # any dtype: bytes count
    region = KVRegion.from_buffer(kv)
    words = kv.reshape(8, -1).view(np.uint32)
    assert kv_block_checksums(region, [5, 1, 5], "mix64") == [f"mix64:{v:016x}" for v in oracle(words, [5, 1, 5])]
    # several blocks in one checksum: the formula over their concatenation
    joined = np.concatenate([words[3], words[6], words[0]])[None, :]
    assert kv_checksum(region, [3, 6, 0], "mix64") == f"mix64:{oracle(joined, [0])[0]:016x}"
    assert kv_checksum(region, [3, 6, 0], "mix64") != kv_checksum(region, [6, 3, 0], "mix64")


def test_pool_words_is_a_view_of_the_host_pool_not_a_copy() -> None:
    kv = np.zeros((4, 32), dtype=np.uint8)
    words = pool_words(KVRegion.from_buffer(kv))
    assert words.shape == (4, 8) and words.dtype == torch.int32
    kv[2, 4:8] = [1, 0, 0, 0]  # little-endian word 1 of block 2
    assert words[2, 1].item() == 1


def test_every_single_flipped_byte_changes_the_checksum() -> None:
    pool = one_byte_flipped_pool(64)
    sums = mix64_block_sums(torch.from_numpy(pool.view(np.int32)), range(len(pool)))
    assert sums == oracle(pool.view(np.uint32), list(range(len(pool))))
    assert sums[0] not in sums[1:]


def test_swapped_words_and_swapped_blocks_change_the_checksums() -> None:
    words = random_words(4, 64, seed=4)
    swapped_words = words.copy()
    swapped_words[0, [10, 50]] = swapped_words[0, [50, 10]]
    assert twin(swapped_words, [0]) != twin(words, [0])
    # P's ticket lists blocks 1 and 2; D's pool holds them swapped: both blocks fail, the others do not
    p_region, d_pool = KVRegion.from_buffer(words), words.copy()
    d_pool[[1, 2]] = d_pool[[2, 1]]
    ticket = kv_block_checksums(p_region, [0, 1, 2, 3], "mix64")
    assert mismatched_blocks(KVRegion.from_buffer(d_pool), [0, 1, 2, 3], ticket) == [1, 2]


def test_mix64_refuses_blocks_that_are_not_whole_words() -> None:
    with pytest.raises(InvalidRequestError, match="multiple of 4 bytes"):
        kv_block_checksums(KVRegion.from_buffer(np.zeros((2, 6), dtype=np.uint8)), [0], "mix64")


@interpreted
@pytest.mark.parametrize(("block_words", "sizes"), [(200, {"chunk_words": 64, "tile_words": 16}), (96, {}),
                                                    (1, {})])
def test_the_triton_kernel_interpreted_equals_the_oracle(block_words: int, sizes: dict[str, int]) -> None:
    words = random_words(5, block_words, seed=6)
    block_ids = [4, 0, 3, 0]
    tensor = torch.from_numpy(words.view(np.int32))
    assert triton_sums(tensor, block_ids, **sizes) == oracle(words, block_ids)
    assert triton_sums(tensor, block_ids, block_words, **sizes) == oracle(words, block_ids, block_words)
    assert triton_sums(tensor, block_ids, 3_000_000_000, **sizes) == oracle(words, block_ids, 3_000_000_000)


@interpreted
def test_the_triton_kernel_interpreted_sees_every_flipped_byte() -> None:
    pool = one_byte_flipped_pool(16)
    sums = triton_sums(torch.from_numpy(pool.view(np.int32)), list(range(len(pool))), chunk_words=2, tile_words=2)
    assert sums == oracle(pool.view(np.uint32), list(range(len(pool))))
    assert sums[0] not in sums[1:]


@pytest.mark.gpu
@compiled_on_cuda
def test_the_compiled_kernel_equals_the_twin_and_the_oracle_on_8b_shaped_blocks() -> None:
    num_blocks, block_words = 320, (2 << 20) // 4
    generator = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn((num_blocks, 32, 2, 16, 8, 128), dtype=torch.bfloat16, device="cuda", generator=generator)
    words = kv.view(torch.int32).view(num_blocks, block_words)
    block_ids = torch.randperm(num_blocks, device="cpu")[:256].tolist()
    from_kernel = triton_sums(words, block_ids)
    assert triton_sums(words, block_ids) == from_kernel  # deterministic
    ids = torch.tensor(block_ids, dtype=torch.int64, device="cuda")
    assert from_kernel == [v % 2**64 for v in mix64_sums_torch(words, ids).cpu().tolist()]
    host = words[torch.tensor(block_ids[:3], device="cuda")].cpu().numpy().view(np.uint32)
    assert from_kernel[:3] == oracle(host, [0, 1, 2])
    region = KVRegion.from_buffer(kv)
    assert kv_block_checksums(region, block_ids) == [f"mix64:{v:016x}" for v in from_kernel]
    # a flipped byte on the GPU is caught in exactly that block
    kv.view(torch.uint8).view(num_blocks, -1)[block_ids[7], 12345] ^= 0x10
    assert mismatched_blocks(region, block_ids, [f"mix64:{v:016x}" for v in from_kernel]) == [block_ids[7]]


@pytest.mark.gpu
@compiled_on_cuda
def test_timing_of_a_16k_token_ticket_on_the_gpu_against_host_copies() -> None:
    num_blocks = 1024  # 16k tokens of 16-token blocks, 2 MiB each: 2 GiB
    kv = torch.randn((num_blocks, 32, 2, 16, 8, 128), dtype=torch.bfloat16, device="cuda")
    region, block_ids = KVRegion.from_buffer(kv), list(range(num_blocks))
    kv_block_checksums(region, block_ids[:8])  # compile
    torch.cuda.synchronize()
    start = time.perf_counter()
    kv_block_checksums(region, block_ids)
    gpu_s = time.perf_counter() - start
    start = time.perf_counter()
    for block in block_ids[:64]:  # the old way, per block: a host copy and xxh3
        kv_checksum(region, [block], "xxh3-128")
    host_s = (time.perf_counter() - start) * num_blocks / 64
    print(f"\nmix64 of {num_blocks} x 2 MiB blocks on the GPU: {gpu_s * 1e3:.2f} ms "
          f"({num_blocks * 2 / 1024 / gpu_s:.0f} GiB/s); per-block host copy + xxh3: {host_s * 1e3:.0f} ms "
          f"(extrapolated from 64 blocks); batched host copies + xxh3: ", end="")
    start = time.perf_counter()
    kv_block_checksums(region, block_ids[:256], "xxh3-128")
    print(f"{(time.perf_counter() - start) * 4 * 1e3:.0f} ms (extrapolated from 256 blocks)")
    assert gpu_s < host_s
