from __future__ import annotations

import pytest
import torch

from engine.kernels import reference
from engine.kernels.decode import DecodeConfig, decode_partitions, paged_decode_attention
from tests.kernels.paged import TOLERANCE, int32, make_block_tables, make_cache, relative_error

gpu = pytest.mark.gpu


def _check_decode(seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                  dtype: torch.dtype, sliding_window: int | None, device: str = "cpu",
                  config: DecodeConfig | None = None) -> None:
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 8
    cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    block_tables = make_block_tables(seq_lens, block_size, num_blocks, device)
    lens = int32(seq_lens, device)
    q = torch.randn(len(seq_lens), num_heads, head_dim, device=device).to(dtype)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))  # every row must be written
    paged_decode_attention(q, cache.k, cache.v, block_tables, lens, scale, sliding_window, out=out,
                           config=config)
    expected = reference.paged_decode_attention(q, cache.k, cache.v, block_tables, lens, scale, sliding_window)
    assert relative_error(out, expected) < TOLERANCE[dtype]


# Small tiles and partitions so a few dozen tokens already span several tiles and partitions.
SPLIT = DecodeConfig(block_n=16, partition_size=16)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (8, 2)])
def test_decode_matches_reference_for_block_sizes_and_gqa_ratios(block_size: int, num_heads: int,
                                                                 num_kv_heads: int) -> None:
    _check_decode([1, 19, 40], num_heads, num_kv_heads, 32, block_size, torch.float32, None, config=SPLIT)


def test_decode_single_partition_writes_output_directly() -> None:
    _check_decode([7, 33], 4, 2, 32, 4, torch.float32, None, config=DecodeConfig(block_n=16))


@pytest.mark.parametrize("window", [1, 5, 20])
def test_decode_sliding_window_drops_old_keys_and_empty_partitions(window: int) -> None:
    _check_decode([3, 24, 45], 4, 2, 32, 4, torch.float32, window, config=SPLIT)


def test_decode_bf16_within_tolerance() -> None:
    _check_decode([9, 37], 8, 2, 32, 16, torch.bfloat16, None, config=SPLIT)


def test_decode_pads_non_power_of_two_head_dim_and_group() -> None:
    _check_decode([6, 21], 6, 2, 24, 4, torch.float32, None, config=SPLIT)


def test_decode_zero_length_sequence_gives_zeros() -> None:
    cache = make_cache(8, 4, 1, 16, torch.float32)
    q = torch.randn(2, 2, 16)
    out = paged_decode_attention(q, cache.k, cache.v, int32([[1, 2], [3, 4]]), int32([0, 5]), 0.25, None,
                                 config=SPLIT)
    assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_decode_partitions_fill_the_device_and_cover_the_context() -> None:
    config = DecodeConfig(programs_per_sm=8, min_partition=256, block_n=64)
    # one sequence, 8 kv heads on 132 multiprocessors: 132 partitions wanted, capped at 32k / 256 = 128
    assert decode_partitions(config, 132, 1, 8, 32768) == (256, 128)
    # once the batch gives every multiprocessor a program, aim for 4 per multiprocessor instead of 8
    assert decode_partitions(config, 132, 64, 8, 1024) == (512, 2)
    # a batch that already fills the device is not split
    assert decode_partitions(config, 132, 256, 8, 1024) == (1024, 1)
    # sizes are whole tiles and cover the context
    size, parts = decode_partitions(config, 132, 8, 8, 8000)
    assert size % 64 == 0 and size * parts >= 8000 and size * (parts - 1) < 8000
    assert decode_partitions(DecodeConfig(partition_size=100), 132, 2, 2, 1000) == (100, 10)


@gpu
@pytest.mark.parametrize("sliding_window", [None, 1000])
def test_decode_on_gpu_llama_shapes_bf16(sliding_window: int | None) -> None:
    seq_lens = [1, 17, 500, 4096, 8191, 3000, 12345, 64]
    _check_decode(seq_lens, 32, 8, 128, 16, torch.bfloat16, sliding_window, "cuda")


@gpu
def test_decode_on_gpu_long_context_single_sequence_splits() -> None:
    _check_decode([32768], 32, 8, 128, 16, torch.bfloat16, None, "cuda")


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 8, 128), (16, 16, 64), (28, 4, 128)])
def test_decode_on_gpu_other_dtypes_and_shapes(dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                                               head_dim: int) -> None:
    _check_decode([5, 1000, 2500], num_heads, num_kv_heads, head_dim, 16, dtype, None, "cuda")
