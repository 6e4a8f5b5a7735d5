"""store_kv: scatter the step's new K/V rows into their paged-cache slots (one program per token)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import check_cache


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_k_token, stride_k_head, stride_k_dim,
    stride_v_token, stride_v_head, stride_v_dim,
    stride_kc_block, stride_kc_slot, stride_kc_head, stride_kc_dim,
    stride_vc_block, stride_vc_slot, stride_vc_head, stride_vc_dim,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
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
    k = tl.load(k_ptr + token * stride_k_token + heads * stride_k_head + dims * stride_k_dim, mask=mask)
    v = tl.load(v_ptr + token * stride_v_token + heads * stride_v_head + dims * stride_v_dim, mask=mask)
    k_dst = k_cache_ptr + page * stride_kc_block + offset * stride_kc_slot
    v_dst = v_cache_ptr + page * stride_vc_block + offset * stride_vc_slot
    tl.store(k_dst + heads * stride_kc_head + dims * stride_kc_dim, k, mask=mask)
    tl.store(v_dst + heads * stride_vc_head + dims * stride_vc_dim, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D] (any strides) -> k_cache/v_cache [num_blocks, block_size, Hkv, D] at slot_mapping [T].

    Slot s is block s // block_size, offset s % block_size; negative slots are skipped. The caches are
    written through their strides, so views of the one [num_blocks, layers, 2, ...] tensor work in place.
    """
    check_cache(k_cache, v_cache)
    num_tokens, num_heads, head_dim = k.shape
    if v.shape != k.shape or k_cache.shape[2:] != (num_heads, head_dim) or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"store_kv shapes disagree: k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"cache {tuple(k_cache.shape)}, slot_mapping {tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_HEADS=num_heads, HEADS_PAD=triton.next_power_of_2(num_heads),
        HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim), PAGE_SIZE=k_cache.shape[1],
        num_warps=4,
    )
