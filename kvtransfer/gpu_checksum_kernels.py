"""The Triton kernels of the mix64 block checksum (the formula: kvtransfer/gpu_checksum.py).

Importing this module imports triton; kvtransfer/gpu_checksum.py imports it only for CUDA tensors (and tests
for CPU tensors under TRITON_INTERPRET=1). A two-stage reduction, deterministic by construction (integer
addition mod 2^64 does not depend on order):
1. `_mix64_partials`: grid (ticket blocks, chunks of a block). Each program reads one chunk of one block,
   `TILE_WORDS` words at a time, mixes every word and sums in uint64 lanes: one partial sum per chunk.
2. `_mix64_totals`: grid (ticket blocks,). Each program adds its block's partials.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtransfer.gpu_checksum import MIX64_MULTIPLIERS, MIX64_SHIFTS

CHUNK_WORDS = 16384  # 64 KiB per program: a 2 MiB block is 32 programs, enough to fill a GPU from ~10 blocks
TILE_WORDS = 2048  # words per load: 16 per thread of 4 warps
MAX_PARTIALS_TILE = 1024


@triton.jit
def _mix64_partials(words_ptr, block_ids_ptr, partials_ptr, block_words, position_stride, num_chunks,
                    CHUNK_WORDS: tl.constexpr, TILE_WORDS: tl.constexpr, MULTIPLIER_1: tl.constexpr,
                    MULTIPLIER_2: tl.constexpr, SHIFT_1: tl.constexpr, SHIFT_2: tl.constexpr, SHIFT_3: tl.constexpr):
    slot = tl.program_id(0)
    chunk = tl.program_id(1)
    block_id = tl.load(block_ids_ptr + slot).to(tl.int64)
    block_start = block_id * block_words  # int64: a pool is often more than 2^31 words
    position_base = slot.to(tl.int64) * position_stride
    chunk_start = chunk.to(tl.int64) * CHUNK_WORDS
    lanes = tl.zeros([TILE_WORDS], dtype=tl.uint64)
    zeros = tl.zeros([TILE_WORDS], dtype=tl.uint64)
    for tile in range(0, CHUNK_WORDS, TILE_WORDS):
        index = chunk_start + tile + tl.arange(0, TILE_WORDS)
        in_block = index < block_words
        word = tl.load(words_ptr + block_start + index, mask=in_block, other=0)
        x = ((position_base + index).to(tl.uint64) << 32) | word.to(tl.uint32, bitcast=True).to(tl.uint64)
        x = (x ^ (x >> SHIFT_1)) * MULTIPLIER_1
        x = (x ^ (x >> SHIFT_2)) * MULTIPLIER_2
        x = x ^ (x >> SHIFT_3)
        lanes += tl.where(in_block, x, zeros)  # a masked lane's x is not zero: it must add nothing
    total = tl.sum(lanes, axis=0)
    tl.store(partials_ptr + slot.to(tl.int64) * num_chunks + chunk, total.to(tl.int64, bitcast=True))


@triton.jit
def _mix64_totals(partials_ptr, totals_ptr, num_chunks, PARTIALS_TILE: tl.constexpr):
    slot = tl.program_id(0)
    row = partials_ptr + slot.to(tl.int64) * num_chunks
    lanes = tl.zeros([PARTIALS_TILE], dtype=tl.uint64)
    for start in range(0, num_chunks, PARTIALS_TILE):
        index = start + tl.arange(0, PARTIALS_TILE)
        partial = tl.load(row + index, mask=index < num_chunks, other=0)
        lanes += partial.to(tl.uint64, bitcast=True)
    tl.store(totals_ptr + slot, tl.sum(lanes, axis=0).to(tl.int64, bitcast=True))


def mix64_sums_triton(words: torch.Tensor, block_ids: torch.Tensor, position_stride: int = 0,
                      chunk_words: int = CHUNK_WORDS, tile_words: int = TILE_WORDS) -> torch.Tensor:
    """int64 [len(block_ids)] of mix64 sums (uint64 bit patterns) of the blocks `block_ids` (int64, on the words'
    device) of `words` ([num_blocks, block_words] int32, contiguous). Powers of two for chunk and tile."""
    assert words.dtype == torch.int32 and words.dim() == 2 and words.is_contiguous(), "words: [blocks, words] int32"
    assert block_ids.dtype == torch.int64 and block_ids.device == words.device, "block ids: int64 on the device"
    block_words = words.shape[1]
    # a tiny block needs no chunk longer than itself (fewer masked tiles, mostly for the CPU interpreter)
    chunk_words = min(chunk_words, triton.next_power_of_2(block_words))
    tile_words = min(tile_words, chunk_words)
    num_slots, num_chunks = len(block_ids), triton.cdiv(block_words, chunk_words)
    partials = torch.empty((num_slots, num_chunks), dtype=torch.int64, device=words.device)
    totals = torch.empty(num_slots, dtype=torch.int64, device=words.device)
    if num_slots == 0:
        return totals
    _mix64_partials[(num_slots, num_chunks)](words, block_ids, partials, block_words, position_stride, num_chunks,
                                             CHUNK_WORDS=chunk_words, TILE_WORDS=tile_words,
                                             MULTIPLIER_1=MIX64_MULTIPLIERS[0], MULTIPLIER_2=MIX64_MULTIPLIERS[1],
                                             SHIFT_1=MIX64_SHIFTS[0], SHIFT_2=MIX64_SHIFTS[1], SHIFT_3=MIX64_SHIFTS[2])
    partials_tile = min(MAX_PARTIALS_TILE, triton.next_power_of_2(num_chunks))
    _mix64_totals[(num_slots,)](partials, totals, num_chunks, PARTIALS_TILE=partials_tile)
    return totals
