"""store_kv: scatter the step's new K/V rows into their paged-cache slots (one program per token);
rotary_and_store_kv: RoPE of the step's q and k and that store, in one launch.

For an FP8 cache (engine/layers/kv_fp8.py) the program quantizes as it stores: per KV head, the row's largest
magnitude picks a power-of-two scale, whose exponent byte goes to the scale view beside the e4m3 values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import check_cache, fp8_scale, fp8_scale_exponent, fp8_scales, round_to_e4m3
from engine.kernels.layers import rotate_heads, rotated_halves, token_cos_sin


@triton.jit
def _quantize_rows(x):
    """x: [HEADS, DIM] float32 -> (e4m3 values, scale exponents [HEADS] uint8)."""
    exponent = fp8_scale_exponent(tl.max(tl.abs(x), 1))
    inverse = fp8_scale(254 - exponent)  # 2**(127 - e): exact, a power of two
    scaled = tl.minimum(tl.maximum(x * inverse[:, None], -448.0), 448.0)
    return round_to_e4m3(scaled).to(tl.float8e4nv), exponent.to(tl.uint8)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_k_token, stride_k_head, stride_k_dim,
    stride_v_token, stride_v_head, stride_v_dim,
    stride_kc_block, stride_kc_slot, stride_kc_head, stride_kc_dim,
    stride_vc_block, stride_vc_slot, stride_vc_head, stride_vc_dim,
    stride_ks_block, stride_ks_slot, stride_ks_head,
    stride_vs_block, stride_vs_slot, stride_vs_head,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, FP8: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    # a negative slot is padding: nothing to store (broadcast first: the interpreter rejects tensor & scalar)
    slots = tl.zeros([HEADS_PAD, 1], tl.int64) + slot
    mask = (heads < NUM_HEADS) & (dims < HEAD_DIM) & (slots >= 0)
    k = tl.load(k_ptr + token * stride_k_token + heads * stride_k_head + dims * stride_k_dim, mask=mask, other=0.0)
    v = tl.load(v_ptr + token * stride_v_token + heads * stride_v_head + dims * stride_v_dim, mask=mask, other=0.0)
    k_dst = k_cache_ptr + page * stride_kc_block + offset * stride_kc_slot
    v_dst = v_cache_ptr + page * stride_vc_block + offset * stride_vc_slot
    if FP8:
        k, k_exponent = _quantize_rows(k.to(tl.float32))
        v, v_exponent = _quantize_rows(v.to(tl.float32))
        head_ids = tl.arange(0, HEADS_PAD)
        head_mask = (head_ids < NUM_HEADS) & (tl.zeros([HEADS_PAD], tl.int64) + slot >= 0)
        tl.store(k_scale_ptr + page * stride_ks_block + offset * stride_ks_slot + head_ids * stride_ks_head,
                 k_exponent, mask=head_mask)
        tl.store(v_scale_ptr + page * stride_vs_block + offset * stride_vs_slot + head_ids * stride_vs_head,
                 v_exponent, mask=head_mask)
    tl.store(k_dst + heads * stride_kc_head + dims * stride_kc_dim, k, mask=mask)
    tl.store(v_dst + heads * stride_vc_head + dims * stride_vc_dim, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """k, v: [T, Hkv, D] (any strides) -> k_cache/v_cache [num_blocks, block_size, Hkv, D] at slot_mapping [T].

    Slot s is block s // block_size, offset s % block_size; negative slots are skipped. The caches are
    written through their strides, so views of the one [num_blocks, layers, 2, ...] tensor work in place.
    With k_scale/v_scale ([num_blocks, block_size, Hkv] uint8) the caches are float8_e4m3fn: the rows are
    quantized (engine/layers/kv_fp8.py) and their scale exponents stored there.
    """
    check_cache(k_cache, v_cache)
    num_tokens, num_heads, head_dim = k.shape
    if v.shape != k.shape or k_cache.shape[2:] != (num_heads, head_dim) or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"store_kv shapes disagree: k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"cache {tuple(k_cache.shape)}, slot_mapping {tuple(slot_mapping.shape)}")
    fp8, k_scales, v_scales = fp8_scales(k_cache, k_scale, v_scale)
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(), *k_scales.stride(), *v_scales.stride(),
        NUM_HEADS=num_heads, HEADS_PAD=triton.next_power_of_2(num_heads),
        HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim), PAGE_SIZE=k_cache.shape[1], FP8=fp8,
        num_warps=4,
    )


@triton.jit
def _rotary_store_kernel(
    positions_ptr, q_ptr, k_ptr, v_ptr, cos_sin_ptr, q_out_ptr, k_out_ptr, k_cache_ptr, v_cache_ptr,
    slot_mapping_ptr,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head, stride_v_token, stride_v_head,
    stride_qo_token, stride_qo_head, stride_ko_token, stride_ko_head, stride_cos_sin,
    stride_kc_block, stride_kc_slot, stride_kc_head, stride_vc_block, stride_vc_slot, stride_vc_head,
    num_q_heads, num_kv_heads,
    Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    token, cos, sin = token_cos_sin(positions_ptr, cos_sin_ptr, stride_cos_sin, HALF, HALF_PAD)
    cols = tl.arange(0, HALF_PAD)[None, :]
    rotate_heads(q_ptr, q_out_ptr, token, stride_q_token, stride_q_head, stride_qo_token, stride_qo_head,
                  cos, sin, num_q_heads, Q_HEADS_PAD, HALF, HALF_PAD)
    k1, k2 = rotated_halves(k_ptr, token, stride_k_token, stride_k_head, cos, sin, num_kv_heads, K_HEADS_PAD, HALF,
                            HALF_PAD)
    heads = tl.arange(0, K_HEADS_PAD)[:, None]
    mask = (heads < num_kv_heads) & (cols < HALF)
    k_out = k_out_ptr + token * stride_ko_token + heads * stride_ko_head + cols
    tl.store(k_out, k1, mask=mask)
    tl.store(k_out + HALF, k2, mask=mask)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # a negative slot is padding: nothing to store (broadcast first: the interpreter rejects tensor & scalar)
    store_mask = mask & (tl.zeros([K_HEADS_PAD, 1], tl.int64) + slot >= 0)
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    k_dst = k_cache_ptr + page * stride_kc_block + offset * stride_kc_slot + heads * stride_kc_head + cols
    tl.store(k_dst, k1, mask=store_mask)
    tl.store(k_dst + HALF, k2, mask=store_mask)
    v_src = v_ptr + token * stride_v_token + heads * stride_v_head + cols
    v_dst = v_cache_ptr + page * stride_vc_block + offset * stride_vc_slot + heads * stride_vc_head + cols
    tl.store(v_dst, tl.load(v_src, mask=store_mask, other=0.0), mask=store_mask)
    tl.store(v_dst + HALF, tl.load(v_src + HALF, mask=store_mask, other=0.0), mask=store_mask)


def rotary_and_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox RoPE of q and k (engine/kernels/layers.py: rotary_embedding) and store_kv of the rotated k and of v, in
    one launch: the same values as the two kernels, one program per token instead of two launches per layer.
    A 16-bit or float32 cache only (an FP8 cache quantizes in store_kv). Returns the rotated (q, k)."""
    check_cache(k_cache, v_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if (k.shape != v.shape or k.shape[::2] != (num_tokens, head_dim) or k_cache.shape[2:] != (num_kv_heads, head_dim)
            or slot_mapping.shape != (num_tokens,) or cos_sin_cache.shape[1] != head_dim or head_dim % 2):
        raise ValueError(f"rotary_and_store_kv shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}, cache {tuple(k_cache.shape)}, slot_mapping {tuple(slot_mapping.shape)}")
    assert k_cache.dtype == k.dtype, "an FP8 cache stores through store_kv"
    assert all(t.stride(-1) == 1 for t in (q, k, v, k_cache, v_cache, cos_sin_cache)), "last dims must be contiguous"
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens:
        half = head_dim // 2
        _rotary_store_kernel[(num_tokens,)](
            positions, q, k, v, cos_sin_cache, q_out, k_out, k_cache, v_cache, slot_mapping,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), num_q_heads, num_kv_heads,
            Q_HEADS_PAD=triton.next_power_of_2(num_q_heads), K_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
            HALF=half, HALF_PAD=triton.next_power_of_2(half), PAGE_SIZE=k_cache.shape[1], num_warps=4,
        )
    return q_out, k_out
