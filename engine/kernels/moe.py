"""Fused mixture-of-experts: the routed experts of one MoE layer in two grouped GEMM launches.

1. align: the T*K (token, expert) pairs are sorted by expert and each expert's run is padded to a multiple of
   BLOCK_M, so every BLOCK_M rows of the sorted order belong to one expert (vLLM's moe_align_block_size).
   Done with torch ops and no device->host sync, so a launch's shape depends only on T, K and E.
2. gate_up: for each block of rows, x[token] @ w13[expert].T over the gate and the up halves at once, then
   SiLU(gate) * up in float32: the [T*K, I] intermediate is written once, never the [T*K, 2I] one.
3. down: intermediate @ w2[expert].T, scaled by the pair's routing weight, written per pair: [T*K, H].
4. combine: the K rows of each token summed (torch, accumulating in float32).

Pairs routed to experts this rank does not hold (expert parallelism over replicated tokens) are sorted past
the end and cost nothing but their zero rows. The twin is engine/kernels/reference.py's fused_moe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.common import dot_precision, upcast_dots


@dataclass(frozen=True)
class MoeTiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def pick_tiles(num_pairs: int, num_experts: int, device: torch.device) -> MoeTiles:
    """Tile sizes by the mean rows an expert gets: decode batches leave most experts a few rows (small
    BLOCK_M wastes less padding), large prefills fill them (large tiles reuse each weight tile more)."""
    if device.type != "cuda":
        return MoeTiles(16, 32, 32, 1, 1)  # the interpreter: few, small programs
    rows_per_expert = num_pairs / max(1, num_experts)
    if rows_per_expert <= 16:
        return MoeTiles(16, 64, 128, 4, 4)
    if rows_per_expert <= 64:
        return MoeTiles(32, 64, 128, 4, 4)
    if rows_per_expert <= 256:
        return MoeTiles(64, 128, 64, 8, 4)
    return MoeTiles(128, 128, 64, 8, 3)


@dataclass(frozen=True)
class AlignedPairs:
    """Pairs sorted by expert, each expert's run padded to whole blocks.

    sorted_pair_ids: [max_padded] pair index (token * K + k), `num_pairs` in padding slots.
    block_expert_ids: [max_padded // block_m] the local expert of each block.
    num_padded: [1] how many leading slots are in use (blocks past it exit at once).
    """

    sorted_pair_ids: torch.Tensor
    block_expert_ids: torch.Tensor
    num_padded: torch.Tensor
    block_m: int


def align_pairs(topk_ids: torch.Tensor, num_local_experts: int, expert_start: int, block_m: int) -> AlignedPairs:
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    local = topk_ids.reshape(-1).long() - expert_start
    held = (local >= 0) & (local < num_local_experts)
    bucket = torch.where(held, local, num_local_experts)  # pairs of other ranks' experts: one bucket past the end
    counts = torch.zeros(num_local_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    counts = counts[:num_local_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    max_padded = triton.cdiv(num_pairs + num_local_experts * (block_m - 1), block_m) * block_m
    order = torch.argsort(bucket, stable=True)
    sorted_bucket = bucket[order]
    rank_in_sorted = torch.arange(num_pairs, device=device)
    unpadded_starts = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    padded_starts = torch.cat([padded.new_zeros(1), padded_ends])
    slot = padded_starts[sorted_bucket] + rank_in_sorted - unpadded_starts[sorted_bucket]
    slot = torch.where(sorted_bucket < num_local_experts, slot, max_padded)  # the last slot is a dump
    sorted_pair_ids = torch.full((max_padded + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids[slot] = order.to(torch.int32)
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    block_expert_ids = torch.searchsorted(padded_ends, block_starts, right=True).clamp_(max=num_local_experts - 1)
    return AlignedPairs(sorted_pair_ids[:max_padded], block_expert_ids.to(torch.int32),
                        padded_ends[-1:].to(torch.int32), block_m)


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, out_ptr, sorted_pair_ids_ptr, block_expert_ids_ptr, num_padded_ptr,
    num_pairs, hidden_size, intermediate_size,
    stride_x_token, stride_w_expert, stride_w_row, stride_out_pair,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_pair_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = pairs < num_pairs
    tokens = pairs // TOP_K
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < intermediate_size
    w_base = w_ptr + expert * stride_w_expert
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < hidden_size
        a = tl.load(x_ptr + tokens[:, None] * stride_x_token + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        # [BLOCK_K, BLOCK_N] tiles of the gate rows and of the up rows (I rows further on)
        w_gate = tl.load(w_base + cols[None, :] * stride_w_row + ks[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(w_base + (cols[None, :] + intermediate_size) * stride_w_row + ks[:, None], mask=w_mask,
                       other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w_gate = w_gate.to(tl.float32)
            w_up = w_up.to(tl.float32)
        gate = tl.dot(a, w_gate, gate, input_precision=PRECISION)
        up = tl.dot(a, w_up, up, input_precision=PRECISION)
    activated = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + pairs[:, None] * stride_out_pair + cols[None, :], activated.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _down_kernel(
    act_ptr, w_ptr, out_ptr, topk_weights_ptr, sorted_pair_ids_ptr, block_expert_ids_ptr, num_padded_ptr,
    num_pairs, hidden_size, intermediate_size,
    stride_act_pair, stride_w_expert, stride_w_row, stride_out_pair,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_pair_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = pairs < num_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns: hidden units
    col_mask = cols < hidden_size
    w_base = w_ptr + expert * stride_w_expert
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, intermediate_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < intermediate_size
        a = tl.load(act_ptr + pairs[:, None] * stride_act_pair + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_w_row + ks[:, None], mask=k_mask[:, None] & col_mask[None, :],
                    other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    weights = tl.load(topk_weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)
    acc = acc * weights[:, None]
    tl.store(out_ptr + pairs[:, None] * stride_out_pair + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, expert_start: int = 0, num_experts: int | None = None,
              tiles: MoeTiles | None = None) -> torch.Tensor:
    """Same contract as engine/kernels/reference.py's fused_moe. x: [T, H]; w13: [E, 2I, H]; w2: [E, H, I];
    topk_weights (any float dtype), topk_ids: [T, K] -> [T, H] in x's dtype. num_experts: how many experts
    the ids range over (None: this rank's E, so every pair is local)."""
    num_tokens, hidden_size = x.shape
    num_local, two_i, w13_hidden = w13.shape
    intermediate_size = two_i // 2
    top_k = topk_ids.shape[1] if topk_ids.dim() == 2 else 1
    if (w13_hidden != hidden_size or two_i % 2 or w2.shape != (num_local, hidden_size, intermediate_size)
            or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != num_tokens):
        raise ValueError(f"fused_moe shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}, topk {tuple(topk_ids.shape)}/{tuple(topk_weights.shape)}")
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1, "last dims must be contiguous"
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    # a pair goes to any of the ids' experts: the rows an expert here gets on average
    tiles = tiles or pick_tiles(num_pairs, num_experts or num_local, x.device)
    aligned = align_pairs(topk_ids, num_local, expert_start, tiles.block_m)
    num_blocks = aligned.block_expert_ids.numel()
    precision = dot_precision(x.dtype)
    upcast = upcast_dots(x.device)
    activated = torch.empty(num_pairs, intermediate_size, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_blocks, triton.cdiv(intermediate_size, tiles.block_n))](
        x, w13, activated, aligned.sorted_pair_ids, aligned.block_expert_ids, aligned.num_padded,
        num_pairs, hidden_size, intermediate_size,
        x.stride(0), w13.stride(0), w13.stride(1), activated.stride(0),
        TOP_K=top_k, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        PRECISION=precision, UPCAST=upcast, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    # pairs of experts held elsewhere are never written: their rows must read as zeros in the combine
    every_pair_local = expert_start == 0 and (num_experts is None or num_experts == num_local)
    alloc = torch.empty if every_pair_local else torch.zeros
    pair_out = alloc(num_pairs, hidden_size, dtype=x.dtype, device=x.device)
    _down_kernel[(num_blocks, triton.cdiv(hidden_size, tiles.block_n))](
        activated, w2, pair_out, topk_weights.reshape(-1).contiguous(), aligned.sorted_pair_ids,
        aligned.block_expert_ids, aligned.num_padded,
        num_pairs, hidden_size, intermediate_size,
        activated.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        PRECISION=precision, UPCAST=upcast, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    # torch's sum of a 16-bit tensor accumulates in float32 and rounds once
    return pair_out.view(num_tokens, top_k, hidden_size).sum(dim=1)
