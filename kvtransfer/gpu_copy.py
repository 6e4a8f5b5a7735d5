"""Copies KV blocks by id between two GPU pools in one kernel launch (the ipc backend's device copy).

Why a kernel: a read moves a prompt's blocks as they lie in two pools under load, mostly short runs. One
`cudaMemcpyAsync` per run costs its launch (~10 µs), which caps a 16k-token read of 670 runs at ~300 GB/s on an
H200; an elementwise `torch._foreach_copy_` over byte views is no better (one byte per element). One launch with
a program per (block, chunk) reads and writes every byte once, at memory speed, whatever the runs.

Importing this module imports triton: `kvtransfer/ipc_cuda.py` imports it for CUDA pools, tests for CPU tensors
under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Measured on the H200 over 8B-shaped 2 MiB blocks (bench/h200/ipc_probe.py, 96 variants): 16 KiB chunks, four
# per program (64 KiB: a 2 MiB block is 32 programs), 16 warps and loads that skip L1 reach 0.81-0.94 of a
# contiguous copy_ for 1k-16k tokens, scattered or not; 32 KiB, one per program, 8 warps: 0.62-0.89.
CHUNK_BYTES = 16384
CHUNKS_PER_PROGRAM = 4
NUM_WARPS = 16
_WORD_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)  # widest first


@triton.jit
def _copy_blocks(source_ptr, destination_ptr, source_ids_ptr, destination_ids_ptr, block_words,
                 CHUNK_WORDS: tl.constexpr, CHUNKS_PER_PROGRAM: tl.constexpr):
    slot = tl.program_id(0)
    group = tl.program_id(1)
    source_block = tl.load(source_ids_ptr + slot).to(tl.int64)  # int64: a pool is often more than 2^31 words
    destination_block = tl.load(destination_ids_ptr + slot).to(tl.int64)
    for step in tl.static_range(CHUNKS_PER_PROGRAM):
        index = (group.to(tl.int64) * CHUNKS_PER_PROGRAM + step) * CHUNK_WORDS + tl.arange(0, CHUNK_WORDS)
        in_block = index < block_words
        words = tl.load(source_ptr + source_block * block_words + index, mask=in_block, cache_modifier=".cg")
        tl.store(destination_ptr + destination_block * block_words + index, words, mask=in_block)


def word_view(blocks: torch.Tensor) -> torch.Tensor:
    """A uint8 [num_blocks, block_bytes] pool as the widest integer words its size and address allow."""
    block_bytes = blocks.shape[1]
    for dtype in _WORD_DTYPES:
        size = dtype.itemsize
        if block_bytes % size == 0 and blocks.data_ptr() % size == 0:
            return blocks.view(dtype)
    raise AssertionError("uint8 always fits")  # pragma: no cover


def copy_blocks(destination: torch.Tensor, source: torch.Tensor, destination_ids: torch.Tensor,
                source_ids: torch.Tensor) -> None:
    """destination[destination_ids[k]] = source[source_ids[k]] for every k, in one launch on the current stream.

    Both pools are uint8 [num_blocks, block_bytes] views with the same block size, on one device (a peer's mapped
    pool counts as ours); the id tensors are int64 on that device (validated by the connector beforehand)."""
    assert destination.shape[1] == source.shape[1], "both pools must have the same block size"
    assert destination_ids.shape == source_ids.shape, "one source block per destination block"
    num_copies = int(destination_ids.numel())
    if num_copies == 0:
        return
    destination_words, source_words = word_view(destination), word_view(source)
    if destination_words.dtype != source_words.dtype:  # both as wide as the narrower allows
        narrow = min(destination_words.dtype.itemsize, source_words.dtype.itemsize)
        dtype = next(d for d in _WORD_DTYPES if d.itemsize == narrow)
        destination_words, source_words = destination.view(dtype), source.view(dtype)
    block_words = destination_words.shape[1]
    chunk_words = min(triton.next_power_of_2(block_words), CHUNK_BYTES // destination_words.dtype.itemsize)
    chunks_per_program = min(CHUNKS_PER_PROGRAM, triton.cdiv(block_words, chunk_words))
    grid = (num_copies, triton.cdiv(block_words, chunk_words * chunks_per_program))
    _copy_blocks[grid](source_words, destination_words, source_ids, destination_ids, block_words,
                       CHUNK_WORDS=chunk_words, CHUNKS_PER_PROGRAM=chunks_per_program, num_warps=NUM_WARPS)
