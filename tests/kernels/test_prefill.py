from __future__ import annotations

import pytest
import torch

from engine.kernels import reference
from engine.kernels.kv_store import store_kv
from engine.kernels.prefill import PrefillConfig, paged_prefill_attention
from tests.kernels.paged import TOLERANCE, PagedCache, int32, make_block_tables, make_cache, relative_error

gpu = pytest.mark.gpu


def _run(cache: PagedCache, q: torch.Tensor, block_tables: torch.Tensor, query_lens: list[int],
         seq_lens: list[int], sliding_window: int | None, config: PrefillConfig | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel output, reference output) for one varlen batch; the output starts poisoned with NaN."""
    device = q.device.type
    starts = int32([sum(query_lens[:b]) for b in range(len(query_lens) + 1)], device)
    lens = int32(seq_lens, device)
    scale = q.shape[-1] ** -0.5
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, cache.k, cache.v, block_tables, starts, lens, scale, sliding_window, out=out,
                            max_query_len=max(query_lens), config=config)
    expected = reference.paged_prefill_attention(q, cache.k, cache.v, block_tables, starts, lens, scale,
                                                 sliding_window)
    return out, expected


def _check_prefill(query_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int,
                   head_dim: int, block_size: int, dtype: torch.dtype, sliding_window: int | None,
                   device: str = "cpu", config: PrefillConfig | None = None) -> None:
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 8
    cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    block_tables = make_block_tables(seq_lens, block_size, num_blocks, device)
    q = torch.randn(sum(query_lens), num_heads, head_dim, device=device).to(dtype)
    out, expected = _run(cache, q, block_tables, query_lens, seq_lens, sliding_window, config)
    assert relative_error(out, expected) < TOLERANCE[dtype]


SMALL = PrefillConfig(block_m=16, block_n=8)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (4, 1)])
def test_prefill_ragged_batch_matches_reference(block_size: int, num_heads: int, num_kv_heads: int) -> None:
    _check_prefill([5, 23, 1], [5, 23, 1], num_heads, num_kv_heads, 32, block_size, torch.float32, None,
                   config=SMALL)


def test_prefill_with_cached_prefix_attends_to_earlier_context() -> None:
    # queries are the last tokens of longer contexts, starting mid-tile
    _check_prefill([7, 1, 12], [30, 17, 12], 4, 2, 32, 4, torch.float32, None, config=SMALL)


@pytest.mark.parametrize("window", [1, 6, 19])
def test_prefill_sliding_window_matches_transformers_definition(window: int) -> None:
    _check_prefill([20, 9], [20, 37], 4, 2, 32, 4, torch.float32, window, config=SMALL)


def test_prefill_bf16_within_tolerance() -> None:
    _check_prefill([18, 6], [18, 25], 4, 2, 32, 16, torch.bfloat16, None, config=SMALL)


def test_prefill_pads_non_power_of_two_head_dim() -> None:
    _check_prefill([9, 4], [9, 20], 3, 1, 24, 4, torch.float32, None, config=SMALL)


def test_prefill_default_config_on_cpu() -> None:
    _check_prefill([40, 3], [40, 50], 2, 1, 32, 16, torch.float32, 16)


def test_chunked_prefill_equals_one_shot_prefill() -> None:
    """Prefill 29 tokens as chunks of 11, 11 and 7, storing each chunk's K/V first: same result as one shot."""
    seq_len, chunks, block_size = 29, [11, 11, 7], 4
    full = make_cache(16, block_size, 2, 32, torch.float32)
    chunked = PagedCache(torch.zeros_like(full.kv))
    block_tables = make_block_tables([seq_len], block_size, 16)
    q = torch.randn(seq_len, 4, 32)
    k, v = torch.randn(seq_len, 2, 32), torch.randn(seq_len, 2, 32)
    slots = (block_tables[0].long()[torch.arange(seq_len) // block_size] * block_size
             + torch.arange(seq_len) % block_size)
    store_kv(k, v, full.k, full.v, slots)
    one_shot, _ = _run(full, q, block_tables, [seq_len], [seq_len], None, SMALL)
    done = 0
    for size in chunks:
        rows = slice(done, done + size)
        store_kv(k[rows], v[rows], chunked.k, chunked.v, slots[rows])
        out, expected = _run(chunked, q[rows], block_tables, [size], [done + size], None, SMALL)
        assert relative_error(out, expected) < TOLERANCE[torch.float32]
        assert relative_error(out, one_shot[rows]) < TOLERANCE[torch.float32]
        done += size


def test_prefill_leaves_rows_outside_its_sequences_untouched() -> None:
    """query_start_loc may start past row 0 (the backend passes decodes' rows too): those rows stay as they were."""
    cache = make_cache(16, 4, 2, 32, torch.float32)
    block_tables = make_block_tables([10, 6], 4, 16)
    q = torch.randn(2 + 10 + 6, 4, 32)
    out = torch.full_like(q, 7.0)
    paged_prefill_attention(q, cache.k, cache.v, block_tables, int32([2, 12, 18]), int32([10, 6]), 0.2, None,
                            out=out, config=SMALL)
    assert torch.equal(out[:2], torch.full_like(out[:2], 7.0))
    expected = reference.paged_prefill_attention(q[2:], cache.k, cache.v, block_tables, int32([0, 10, 16]),
                                                 int32([10, 6]), 0.2, None)
    assert relative_error(out[2:], expected) < TOLERANCE[torch.float32]


def test_prefill_dense_from_skips_only_fresh_prompts_that_long() -> None:
    """dense_from=8: the fresh 10-token prompt is left to the caller; the fresh 6-token prompt and the 5-query
    chunk of a 12-token context (a cached prefix) are attended."""
    cache = make_cache(16, 4, 2, 32, torch.float32)
    block_tables = make_block_tables([10, 6, 12], 4, 16)
    starts, lens = int32([0, 10, 16, 21]), int32([10, 6, 12])
    q = torch.randn(21, 4, 32)
    out = torch.full_like(q, 7.0)
    paged_prefill_attention(q, cache.k, cache.v, block_tables, starts, lens, 0.2, None, out=out, config=SMALL,
                            dense_from=8)
    assert torch.equal(out[:10], torch.full_like(out[:10], 7.0))
    expected = reference.paged_prefill_attention(q, cache.k, cache.v, block_tables, starts, lens, 0.2, None)
    assert relative_error(out[10:], expected[10:]) < TOLERANCE[torch.float32]


@gpu
@pytest.mark.parametrize("sliding_window", [None, 700])
def test_prefill_on_gpu_llama_shapes_bf16(sliding_window: int | None) -> None:
    # a fresh prompt, a prefix-cache hit, a chunk of a long prompt, and a single-token tail
    query_lens, seq_lens = [3000, 1200, 2048, 1], [3000, 5000, 6144, 900]
    _check_prefill(query_lens, seq_lens, 32, 8, 128, 16, torch.bfloat16, sliding_window, "cuda")


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 8, 128), (16, 16, 64), (28, 4, 128)])
def test_prefill_on_gpu_other_dtypes_and_shapes(dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                                                head_dim: int) -> None:
    _check_prefill([700, 300], [700, 1000], num_heads, num_kv_heads, head_dim, 16, dtype, None, "cuda")
