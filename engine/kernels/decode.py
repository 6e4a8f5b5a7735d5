"""Paged decode attention, split along the context (flash-decoding).

Grid (sequence, kv head, partition). A program takes one KV head's whole query-head group (GQA), so each
K/V row is read from memory once, and walks its partition of the context in tiles of BLOCK_N tokens with
an online softmax in float32. Several partitions per sequence keep the GPU full when the batch is small
and the context long; a second kernel merges the partitions' results by their log-sum-exp. With one
partition the first kernel writes the output itself and the merge is skipped.
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
    num_sms,
    pad_dim,
    upcast_dots,
)


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int = 64  # keys per tile
    num_warps: int = 4
    num_stages: int = 3
    # How many programs to aim for, per multiprocessor, when choosing partitions; fewer once the batch alone
    # (sequences x kv heads) gives every multiprocessor a program, where extra splits cost more than they
    # balance (H200, bench/results/KERNEL-NOTES.md: batch 64 x 1k context at 83% of read bandwidth with
    # 3 partitions, 89% with 2).
    programs_per_sm: int = 8
    programs_per_sm_large_batch: int = 4
    # never split the context finer than this many tokens: at short contexts a small batch is latency-bound,
    # and finer splits pay (H200, bench/h200/decode_sweep.py: batch 1 x 1k 9.3 -> 6.8 us with 128 instead of
    # 256, batch 8 x 1k 16.8 -> 15.7 us, batch 1 x 8k 16.9 -> 16.1 us; 64 gave 6.0 us at batch 1 but lost at
    # batch 8, and 32 lost 10% at batch 64)
    min_partition: int = 128
    partition_size: int | None = None  # fixed partition length (tests, tuning); overrides the two above


def default_decode_config(device: torch.device, dtype: torch.dtype) -> DecodeConfig:
    if device.type != "cuda":
        return DecodeConfig(block_n=32, min_partition=64)
    if dtype == torch.float32:
        return DecodeConfig(num_stages=2)  # float32 tiles are twice the bytes: fewer stages fit in shared memory
    return DecodeConfig()


# not specialised on what changes from step to step (see engine/kernels/prefill.py): one compilation serves
# every eager step and every graph
@triton.jit(do_not_specialize=["stride_table_seq", "sliding_window"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, k_scale_ptr, v_scale_ptr,
    stride_q_seq, stride_q_head, stride_q_dim,
    stride_k_block, stride_k_slot, stride_k_head, stride_k_dim,
    stride_v_block, stride_v_slot, stride_v_head, stride_v_dim,
    stride_ks_block, stride_ks_slot, stride_ks_head,
    stride_vs_block, stride_vs_slot, stride_vs_head,
    stride_table_seq,
    stride_o_seq, stride_o_head, stride_o_dim,
    qk_scale, sliding_window, partition_size,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr, SPLIT: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # the query sits at seq_len - 1; this partition covers keys [start, end)
    start = part * partition_size
    end = tl.minimum(start + partition_size, seq_len)
    if SLIDING:
        start = tl.maximum(start, seq_len - sliding_window)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    q_mask = row_mask[:, None] & (dims[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :] * stride_q_dim,
                mask=q_mask, other=0.0)

    m_i = tl.full([GROUP_PAD], MAX_START, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_table_seq
    k_base = k_cache_ptr + kv_head * stride_k_head + dims[None, :] * stride_k_dim
    v_base = v_cache_ptr + kv_head * stride_v_head + dims[None, :] * stride_v_dim
    ks_base = k_scale_ptr + kv_head * stride_ks_head
    vs_base = v_scale_ptr + kv_head * stride_vs_head
    for tile_start in range(start, end, BLOCK_N):
        keys = tile_start + tl.arange(0, BLOCK_N)
        key_mask = keys < end
        page = tl.load(table + keys // PAGE_SIZE, mask=key_mask, other=0).to(tl.int64)
        slot = keys % PAGE_SIZE
        if DIM_PAD == HEAD_DIM:
            kv_mask = key_mask[:, None]
        else:
            kv_mask = key_mask[:, None] & (dims[None, :] < HEAD_DIM)
        k = load_kv_tile(k_base, page, slot, stride_k_block, stride_k_slot, kv_mask, True)
        v = load_kv_tile(v_base, page, slot, stride_v_block, stride_v_slot, kv_mask, True)
        k_scale = load_scale_tile(ks_base, page, slot, stride_ks_block, stride_ks_slot, key_mask, True, FP8)
        v_scale = load_scale_tile(vs_base, page, slot, stride_vs_block, stride_vs_slot, key_mask, True, FP8)
        m_i, l_i, acc = attend_tile(q, k, v, m_i, l_i, acc, key_mask[None, :], qk_scale, True, PRECISION,
                                    UPCAST, k_scale, v_scale, FP8)

    result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLIT:
        # partials: [B, Hq, P, D] and [B, Hq, P], contiguous; an empty partition leaves sum 0
        num_parts = tl.num_programs(2)
        part_rows = (seq * tl.num_programs(1) * GROUP + heads) * num_parts + part
        tl.store(part_out_ptr + part_rows[:, None] * HEAD_DIM + dims[None, :], result, mask=q_mask)
        tl.store(part_max_ptr + part_rows, m_i, mask=row_mask)
        tl.store(part_sum_ptr + part_rows, l_i, mask=row_mask)
    else:
        tl.store(out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + dims[None, :] * stride_o_dim,
                 result.to(out_ptr.dtype.element_ty), mask=q_mask)


# the partitions are merged PARTS_BLOCK at a time, so one compilation serves every partition count
@triton.jit(do_not_specialize=["num_parts"])
def _merge_kernel(
    part_out_ptr, part_max_ptr, part_sum_ptr, out_ptr,
    stride_o_seq, stride_o_head, stride_o_dim, num_parts,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, PARTS_BLOCK: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, DIM_PAD)
    first_row = (seq * tl.num_programs(1) + head) * num_parts
    top = MAX_START
    for start in range(0, num_parts, PARTS_BLOCK):
        parts = start + tl.arange(0, PARTS_BLOCK)
        maxes = tl.load(part_max_ptr + first_row + parts, mask=parts < num_parts, other=MAX_START)
        top = tl.maximum(top, tl.max(maxes, 0))
    total = 0.0
    merged = tl.zeros([DIM_PAD], tl.float32)
    for start in range(0, num_parts, PARTS_BLOCK):
        parts = start + tl.arange(0, PARTS_BLOCK)
        part_mask = parts < num_parts
        maxes = tl.load(part_max_ptr + first_row + parts, mask=part_mask, other=MAX_START)
        sums = tl.load(part_sum_ptr + first_row + parts, mask=part_mask, other=0.0)
        weights = sums * tl.exp2(maxes - top)
        # empty partitions were never written: their rows must not be read (0 * NaN is NaN)
        o_mask = (part_mask & (sums > 0))[:, None] & (dims[None, :] < HEAD_DIM)
        outs = tl.load(part_out_ptr + (first_row + parts)[:, None] * HEAD_DIM + dims[None, :], mask=o_mask,
                       other=0.0)
        total += tl.sum(weights, 0)
        merged += tl.sum(weights[:, None] * outs, 0)
    merged = merged / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_o_seq + head * stride_o_head + dims * stride_o_dim,
             merged.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def decode_partitions(config: DecodeConfig, num_multiprocessors: int, batch: int, num_kv_heads: int,
                      max_context: int) -> tuple[int, int]:
    """(partition_size, num_partitions) covering max_context tokens, enough programs to fill the device."""
    if config.partition_size is not None:
        size = config.partition_size
    else:
        base = batch * num_kv_heads
        per_sm = config.programs_per_sm if base < num_multiprocessors else config.programs_per_sm_large_batch
        target = per_sm * num_multiprocessors
        most = max(1, triton.cdiv(max_context, config.min_partition))
        parts = min(max(1, triton.cdiv(target, base)), most)
        size = triton.cdiv(triton.cdiv(max_context, parts), config.block_n) * config.block_n
    return size, max(1, triton.cdiv(max_context, size))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           sliding_window: int | None, *, out: torch.Tensor | None = None,
                           max_seq_len: int | None = None, config: DecodeConfig | None = None,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, Hq, D], one query per sequence at position seq_lens[b] - 1 -> [B, Hq, D] (written into out).

    block_tables: [B, max_blocks] int32; seq_lens: [B] int32 (0 gives a zero row). The partitioning is
    sized from max_seq_len, which defaults to the block table's capacity: no device sync, and the launch
    shape stays fixed for CUDA graphs. A max_seq_len below a real seq_len gives wrong results.
    k_scale, v_scale: an FP8 cache's scale exponents (engine/kernels/kv_store.py); the math stays in q's dtype.
    """
    check_cache(k_cache, v_cache)
    fp8, k_scales, v_scales = fp8_scales(k_cache, k_scale, v_scale)
    batch, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads or k_cache.shape[3] != head_dim:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    config = config or default_decode_config(q.device, q.dtype)
    max_context = max_seq_len if max_seq_len is not None else block_tables.shape[1] * page_size
    partition_size, num_parts = decode_partitions(config, num_sms(q.device), batch, num_kv_heads, max_context)
    split = num_parts > 1
    group = num_heads // num_kv_heads
    if split:
        part_out = torch.empty(batch, num_heads, num_parts, head_dim, device=q.device, dtype=torch.float32)
        part_max = torch.empty(batch, num_heads, num_parts, device=q.device, dtype=torch.float32)
        part_sum = torch.empty_like(part_max)
    else:
        part_out = part_max = part_sum = out  # unused
    _decode_kernel[(batch, num_kv_heads, num_parts)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_max, part_sum, k_scales, v_scales,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *k_scales.stride(), *v_scales.stride(),
        block_tables.stride(0), *out.stride(),
        scale * LOG2_E, sliding_window or 0, partition_size,
        GROUP=group, GROUP_PAD=pad_dim(group), HEAD_DIM=head_dim, DIM_PAD=pad_dim(head_dim),
        PAGE_SIZE=page_size, BLOCK_N=config.block_n, SLIDING=sliding_window is not None, SPLIT=split,
        PRECISION=dot_precision(q.dtype), UPCAST=upcast_dots(q.device), FP8=fp8,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split:
        _merge_kernel[(batch, num_heads)](
            part_out, part_max, part_sum, out, *out.stride(), num_parts,
            HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim), PARTS_BLOCK=16, num_warps=4,
        )
    return out
