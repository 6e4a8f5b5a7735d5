"""Paged prefill attention over a varlen batch, causal, with prefix-cache hits and chunked prefill.

Sequence b's queries are the last num_queries(b) = query_start_loc[b+1] - query_start_loc[b] tokens of its
seq_lens[b]-token context; every key, including the new tokens', is read from the paged cache.

Grid (query head, sequence, query tile). Query tiles are BLOCK_M positions aligned to multiples of BLOCK_M
in the context, numbered from the end of each sequence so the tiles with the most keys start first:

    context:  0 ............................................ seq_len
              |<-- cached prefix -->|<------ queries ------->|
    tiles:                  [  t-2  ][  t-1  ][   t   ][ last ]   (rows outside the queries are masked)
    keys of tile t: [lo, tile_start) with no causal mask (stage 1), then the diagonal tile (stage 2)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.common import (
    LOG2_E,
    MAX_START,
    attend_tile,
    check_cache,
    dot_precision,
    fp8_scales,
    load_kv_tile,
    load_scale_tile,
    pad_dim,
    upcast_dots,
)


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int = 128  # query positions per program
    block_n: int = 128  # keys per tile; must divide block_m
    num_warps: int = 8
    num_stages: int = 3
    warp_specialize: bool = False  # Triton's automatic warp specialization of the main loop (experimental)


def default_prefill_config(device: torch.device, dtype: torch.dtype) -> PrefillConfig:
    if device.type != "cuda":
        return PrefillConfig(block_m=32, block_n=16)
    if dtype == torch.float32:
        return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    return PrefillConfig()


@triton.jit
def _attend_earlier_keys(q, m_i, l_i, acc, key_start, pos, table, k_base, v_base, stride_k_block, stride_k_slot,
                         stride_v_block, stride_v_slot, dim_mask, qk_scale, sliding_window,
                         ks_base, vs_base, stride_ks_block, stride_ks_slot, stride_vs_block, stride_vs_slot,
                         HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
                         BLOCK_N: tl.constexpr, SLIDING: tl.constexpr, PRECISION: tl.constexpr,
                         UPCAST: tl.constexpr, FP8: tl.constexpr):
    """Stage 1 step: keys [key_start, key_start + BLOCK_N), all before the query tile, so no causal mask."""
    keys = key_start + tl.arange(0, BLOCK_N)
    page = tl.load(table + keys // PAGE_SIZE).to(tl.int64)
    slot = keys % PAGE_SIZE
    k = load_kv_tile(k_base, page, slot, stride_k_block, stride_k_slot, dim_mask, DIM_PAD != HEAD_DIM)
    v = load_kv_tile(v_base, page, slot, stride_v_block, stride_v_slot, dim_mask, DIM_PAD != HEAD_DIM)
    k_scale = load_scale_tile(ks_base, page, slot, stride_ks_block, stride_ks_slot, None, False, FP8)
    v_scale = load_scale_tile(vs_base, page, slot, stride_vs_block, stride_vs_slot, None, False, FP8)
    if SLIDING:
        allowed = pos[:, None] - keys[None, :] < sliding_window
    else:
        allowed = None
    return attend_tile(q, k, v, m_i, l_i, acc, allowed, qk_scale, SLIDING, PRECISION, UPCAST, k_scale, v_scale,
                       FP8)


# Arguments that change from step to step are not specialised on (Triton would compile a variant for an int
# that is 1 or a multiple of 16, and for a pointer 16-byte aligned or not): the metadata is sliced past the
# step's decodes, and the block table's width follows the longest context. Each new variant is a compilation
# of over a second inside a serving step (bench/offline_gpu.py --trace).
@triton.jit(do_not_specialize=["stride_table_seq", "sliding_window", "dense_from"],
            do_not_specialize_on_alignment=["block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    k_scale_ptr, v_scale_ptr,
    stride_q_token, stride_q_head, stride_q_dim,
    stride_k_block, stride_k_slot, stride_k_head, stride_k_dim,
    stride_v_block, stride_v_slot, stride_v_head, stride_v_dim,
    stride_ks_block, stride_ks_slot, stride_ks_head,
    stride_vs_block, stride_vs_slot, stride_vs_head,
    stride_table_seq,
    stride_o_token, stride_o_head, stride_o_dim,
    qk_scale, sliding_window, dense_from,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, FP8: tl.constexpr,
):
    head = tl.program_id(0)
    seq = tl.program_id(1)
    tile_from_end = tl.program_id(2)
    kv_head = head // GROUP
    query_start = tl.load(query_start_loc_ptr + seq)
    num_queries = tl.load(query_start_loc_ptr + seq + 1) - query_start
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - num_queries
    tile_start = (tl.cdiv(seq_len, BLOCK_M) - 1 - tile_from_end) * BLOCK_M
    if tile_start + BLOCK_M <= first_pos:
        return
    if dense_from > 0 and first_pos == 0 and num_queries >= dense_from:
        return  # a fresh prompt the caller attends densely (engine/kernels/backend.py)

    pos = tile_start + tl.arange(0, BLOCK_M)
    row_mask = (pos >= first_pos) & (pos < seq_len)
    dims = tl.arange(0, DIM_PAD)
    if DIM_PAD == HEAD_DIM:
        q_mask = row_mask[:, None]
    else:
        q_mask = row_mask[:, None] & (dims[None, :] < HEAD_DIM)
    q_rows = (query_start + pos - first_pos).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_q_token + head * stride_q_head + dims[None, :] * stride_q_dim,
                mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_M], MAX_START, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_table_seq
    k_base = k_cache_ptr + kv_head * stride_k_head + dims[None, :] * stride_k_dim
    v_base = v_cache_ptr + kv_head * stride_v_head + dims[None, :] * stride_v_dim
    dim_mask = dims[None, :] < HEAD_DIM
    ks_base = k_scale_ptr + kv_head * stride_ks_head
    vs_base = v_scale_ptr + kv_head * stride_vs_head

    # Stage 1: keys before the tile, all visible to every row (tile_start < seq_len, so no bounds masks).
    lo = 0
    if SLIDING:
        lo = tl.maximum(tile_start - sliding_window + 1, 0) // BLOCK_N * BLOCK_N
    if WARP_SPECIALIZE:
        for key_start in tl.range(lo, tile_start, BLOCK_N, warp_specialize=True):
            m_i, l_i, acc = _attend_earlier_keys(
                q, m_i, l_i, acc, key_start, pos, table, k_base, v_base, stride_k_block, stride_k_slot,
                stride_v_block, stride_v_slot, dim_mask, qk_scale, sliding_window,
                ks_base, vs_base, stride_ks_block, stride_ks_slot, stride_vs_block, stride_vs_slot,
                HEAD_DIM, DIM_PAD, PAGE_SIZE, BLOCK_N, SLIDING, PRECISION, UPCAST, FP8)
    else:
        for key_start in range(lo, tile_start, BLOCK_N):
            m_i, l_i, acc = _attend_earlier_keys(
                q, m_i, l_i, acc, key_start, pos, table, k_base, v_base, stride_k_block, stride_k_slot,
                stride_v_block, stride_v_slot, dim_mask, qk_scale, sliding_window,
                ks_base, vs_base, stride_ks_block, stride_ks_slot, stride_vs_block, stride_vs_slot,
                HEAD_DIM, DIM_PAD, PAGE_SIZE, BLOCK_N, SLIDING, PRECISION, UPCAST, FP8)

    # Stage 2: the diagonal, keys [tile_start, tile_start + BLOCK_M) under the causal mask.
    for key_start in range(tile_start, tl.minimum(tile_start + BLOCK_M, seq_len), BLOCK_N):
        keys = key_start + tl.arange(0, BLOCK_N)
        key_mask = keys < seq_len
        page = tl.load(table + keys // PAGE_SIZE, mask=key_mask, other=0).to(tl.int64)
        slot = keys % PAGE_SIZE
        if DIM_PAD == HEAD_DIM:
            kv_mask = key_mask[:, None]
        else:
            kv_mask = key_mask[:, None] & dim_mask
        k = load_kv_tile(k_base, page, slot, stride_k_block, stride_k_slot, kv_mask, True)
        v = load_kv_tile(v_base, page, slot, stride_v_block, stride_v_slot, kv_mask, True)
        k_scale = load_scale_tile(ks_base, page, slot, stride_ks_block, stride_ks_slot, key_mask, True, FP8)
        v_scale = load_scale_tile(vs_base, page, slot, stride_vs_block, stride_vs_slot, key_mask, True, FP8)
        allowed = keys[None, :] <= pos[:, None]
        if SLIDING:
            allowed = allowed & (pos[:, None] - keys[None, :] < sliding_window)
        m_i, l_i, acc = attend_tile(q, k, v, m_i, l_i, acc, allowed, qk_scale, True, PRECISION, UPCAST,
                                    k_scale, v_scale, FP8)

    result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_o_token + head * stride_o_head + dims[None, :] * stride_o_dim,
             result.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            scale: float, sliding_window: int | None, *, out: torch.Tensor | None = None,
                            max_query_len: int | None = None, config: PrefillConfig | None = None,
                            dense_from: int = 0, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]: causal attention of each sequence's queries over its cached context.

    query_start_loc: [B+1] int32, sequence b's queries are q rows [start[b], start[b+1]) (start[0] may be
    past 0: rows outside [start[0], start[B]) are neither read nor written, so a caller can pass the whole
    batch's q and out and only the prefill sequences' metadata). seq_lens, block_tables: [B], [B, max_blocks]
    int32. The new tokens' K/V must already be in the cache. max_query_len (a host int) bounds the grid;
    it defaults to T. dense_from > 0 skips the sequences without a cached prefix (all of their context is
    new) of at least dense_from queries: their rows of `out` are left to the caller. k_scale, v_scale: an FP8
    cache's scale exponents (engine/kernels/kv_store.py); the math stays in q's dtype.
    """
    check_cache(k_cache, v_cache)
    fp8, k_scales, v_scales = fp8_scales(k_cache, k_scale, v_scale)
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads or k_cache.shape[3] != head_dim:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    out = torch.empty_like(q) if out is None else out
    batch = seq_lens.shape[0]
    max_query_len = num_tokens if max_query_len is None else max_query_len
    if batch == 0 or max_query_len == 0:
        return out
    config = config or default_prefill_config(q.device, q.dtype)
    assert config.block_m % config.block_n == 0, f"block_n must divide block_m: {config}"
    # a sequence's queries may start mid-tile, so they can touch one tile more than cdiv(queries, BLOCK_M)
    num_tiles = triton.cdiv(max_query_len, config.block_m) + 1
    _prefill_kernel[(num_heads, batch, num_tiles)](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, k_scales, v_scales,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *k_scales.stride(), *v_scales.stride(),
        block_tables.stride(0), *out.stride(),
        scale * LOG2_E, sliding_window or 0, dense_from,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, DIM_PAD=pad_dim(head_dim), PAGE_SIZE=page_size,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, SLIDING=sliding_window is not None,
        PRECISION=dot_precision(q.dtype), UPCAST=upcast_dots(q.device),
        WARP_SPECIALIZE=config.warp_specialize, FP8=fp8, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
