"""Paged attention: the metadata a step carries, the backend seam, and the plain-torch backend.

KV cache layout (one tensor per rank, block-major so one block of every layer is one contiguous region and a run
of blocks is one transfer descriptor; head-major within a block, so one KV head of a block, all layers, is one
contiguous *head unit*: a tensor-parallel rank's slice of a block is a run of head units, and a node of another
TP size pulls the heads it owns as such runs, node_common/sharded_kv.py):

    kv_cache: [num_blocks, num_kv_heads, num_layers, 2, block_size, head_dim]

A layer sees strided views `k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]` (a KVCacheLayer).
An FP8 cache (engine/layers/kv_fp8.py) is a uint8 pool instead: its views are float8_e4m3fn values of the same
shape plus `k_scale, v_scale: [num_blocks, block_size, num_kv_heads]` uint8 scale exponents, one per row.
Token `t` of a sequence lives in block `block_table[t // block_size]` at offset `t % block_size`; its flat
slot is `block_id * block_size + offset`.

A batch is ordered decodes first: the first `num_decodes` sequences have exactly one query token, so the
backend can treat them as one batched gather, and the rest (prefill chunks) one by one.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine.layers import cpu_kernels, cpu_paged_attention, kv_fp8
from engine.layers.cpu_linear import HALF_TYPES, has_half_dot_product


class KVCacheLayer(NamedTuple):
    """One layer's views of the KV pool; the scales only for an FP8 cache (a plain (k, v) tuple reads as one)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is stored
    query_start_loc: torch.Tensor  # [B+1] int32: sequence b's queries are rows [start[b], start[b+1])
    seq_lens: torch.Tensor  # [B] int32: tokens of context (cached + new) after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    num_decodes: int  # sequences [0, num_decodes) have one query token each
    # host copies, so the torch backend's per-sequence loop never syncs with the device
    query_start_loc_host: list[int]
    seq_lens_host: list[int]
    sliding_window: int | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)


class AttentionBackend(abc.ABC):
    """Stores the step's new K/V into the paged cache and attends over it."""

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                kv_stored: bool = False) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] for the new tokens. Returns [T, Hq, D].

        With k_scale/v_scale the cache is FP8: the new rows are quantized as they are stored, and attention reads
        the dequantized context (the math runs in q's dtype or float32, never in FP8). kv_stored: the caller has
        already stored k and v at meta.slot_mapping (a fused RoPE + store, engine/model/llama.py)."""

    def warm_up(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                max_prompt_tokens: int, max_step_tokens: int) -> None:
        """Builds what the first step of a new shape would otherwise build inside a request (execution plans of
        library kernels). Nothing to build by default."""
        return None


def allowed_keys(query_pos: torch.Tensor, key_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Causal mask (with an optional sliding window, as transformers defines it: q - k < window)."""
    allowed = key_pos[None, :] <= query_pos[:, None]
    if sliding_window is not None:
        allowed &= key_pos[None, :] > query_pos[:, None] - sliding_window
    return allowed


class TorchAttention(AttentionBackend):
    """A clear implementation over the paged cache, checked against the einsum oracle (tests/unit/test_cpu_attention.py,
    its decodes through the in-place CPU kernel where that is built; bf16 prefills on AVX512-BF16 through the prefill
    kernel, tests/unit/test_cpu_prefill_attention.py); the reference the Triton kernels are checked against."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                kv_stored: bool = False) -> torch.Tensor:
        if not kv_stored:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = decode_attention(q[:nd], k_cache, v_cache, meta.block_tables[:nd],
                                        meta.seq_lens[:nd], scale, meta.sliding_window, k_scale, v_scale)
        starts = meta.query_start_loc_host
        for b in range(nd, meta.num_seqs):
            rows = slice(starts[b], starts[b + 1])
            out[rows] = prefill_attention(q[rows], k_cache, v_cache, meta.block_tables[b],
                                          meta.seq_lens_host[b], scale, meta.sliding_window, k_scale, v_scale)
        return out


def attention_dtype(q: torch.Tensor) -> torch.dtype:
    """What SDPA computes in: float32 for half-precision queries on a CPU without half dot products, where
    SDPA's bf16 kernel is 5-9x slower than its float32 one (a batch-64 decode on the bench box: 211 ms vs
    24 ms). Half values are exact in float32 and the kernel accumulates in float32 either way; the output
    is rounded back."""
    if q.device.type == "cpu" and q.dtype in HALF_TYPES and not has_half_dot_product():
        return torch.float32
    return q.dtype


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    block_size = k_cache.shape[1]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    if k_scale is None or v_scale is None:
        k_cache[blocks, offsets] = k
        v_cache[blocks, offsets] = v
        return
    for rows, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        values, exponents = kv_fp8.quantize(rows)
        # through a uint8 view: indexed writes of float8 tensors are not implemented on every device
        cache.view(torch.uint8)[blocks, offsets] = values.view(torch.uint8)
        scales[blocks, offsets] = exponents


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int,
                   scales: torch.Tensor | None = None) -> torch.Tensor:
    """The first num_tokens of one sequence: [num_tokens, Hkv, D] (float32 from an FP8 cache)."""
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    blocks = block_table[:num_blocks].long()
    if scales is None:
        return cache[blocks].flatten(0, 1)[:num_tokens]
    values = cache.view(torch.uint8)[blocks].view(cache.dtype).flatten(0, 1)[:num_tokens]
    return kv_fp8.dequantize(values, scales[blocks].flatten(0, 1)[:num_tokens])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_table: torch.Tensor, seq_len: int, scale: float,
                      sliding_window: int | None, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of one sequence's last q.shape[0] tokens over its whole context. q: [Tq, Hq, D]. On a CPU
    with AVX512-BF16 and a bf16 model, the C++ kernel (engine/layers/cpu_prefill_attention.cpp) that reads K/V in
    place; else a gather of the context and SDPA."""
    if _prefill_kernel_serves(q, k_cache, v_cache, k_scale):
        module = cpu_kernels.kernel()
        assert module is not None, "_prefill_kernel_serves() says the kernels are built"
        return module.paged_prefill_attention(q, k_cache, v_cache, block_table.to(torch.int32).contiguous(), seq_len,
                                              scale, sliding_window or 0)
    num_queries = q.shape[0]
    dtype = attention_dtype(q)
    keys = gather_context(k_cache, block_table, seq_len, k_scale).to(dtype)
    values = gather_context(v_cache, block_table, seq_len, v_scale).to(dtype)
    key_pos = torch.arange(seq_len, device=q.device)
    mask = allowed_keys(key_pos[seq_len - num_queries:], key_pos, sliding_window)
    # 4-D [1, H, T, D] inputs: with 3-D ones SDPA takes its slow math path on CPU (~7x slower)
    out = F.scaled_dot_product_attention(q.to(dtype).transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                         values.transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1).to(q.dtype)


_PREFILL_KERNEL_HEAD_SIZES = (32, 64, 128, 256)  # those cpu_prefill_attention.cpp is instantiated for


def _prefill_kernel_serves(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           k_scale: torch.Tensor | None) -> bool:
    """Whether the C++ kernel computes this prefill: CPU, bf16 queries and a bf16 cache (an FP8 cache takes the torch
    path), a head size it is built for, rows of contiguous values. Runs for every sequence of every layer: cheap."""
    return (q.device.type == "cpu" and q.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16
            and v_cache.dtype == torch.bfloat16 and k_scale is None and q.shape[-1] in _PREFILL_KERNEL_HEAD_SIZES
            and q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
            and cpu_kernels.has_bf16_dot())


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     sliding_window: int | None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence, all sequences at once. q: [B, Hq, D] -> [B, Hq, D]. On a CPU with the
    in-place kernel (engine/layers/cpu_paged_attention.py) that kernel; else a gather of the context and SDPA."""
    if cpu_paged_attention.serves(q, k_cache, k_scale):
        return cpu_paged_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                                          sliding_window)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    flat_table = block_tables.reshape(-1).long()
    dtype = attention_dtype(q)
    # index_select along blocks is a memcpy per block and leaves [B, L, Hkv, D] contiguous (gathering K and
    # V in one op is no cheaper: splitting them afterwards costs another copy)
    keys = _gather_blocks(k_cache, k_scale, flat_table).reshape(batch, -1, num_kv_heads, head_dim).to(dtype)
    values = _gather_blocks(v_cache, v_scale, flat_table).reshape(batch, -1, num_kv_heads, head_dim).to(dtype)
    key_pos = torch.arange(keys.shape[1], device=q.device)
    query_pos = (seq_lens.long() - 1)[:, None]
    allowed = key_pos[None, :] <= query_pos
    if sliding_window is not None:
        allowed &= key_pos[None, :] > query_pos - sliding_window
    # The query heads sharing a KV head go in as that head's queries ([B, Hkv, Hq/Hkv, D]): all have the same
    # position, so one mask row serves them, and SDPA's CPU kernel then tiles queries instead of repeating
    # K/V per head (25% faster than enable_gqa). SDPA's fused CPU kernel beats an einsum formulation 2-3x.
    grouped = q.to(dtype).view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=allowed[:, None, None], scale=scale)
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


def _gather_blocks(cache: torch.Tensor, scales: torch.Tensor | None, blocks: torch.Tensor) -> torch.Tensor:
    """The cache's blocks [n, block_size, Hkv, D]: as stored, or dequantized to float32 from an FP8 cache."""
    if scales is None:
        return cache.index_select(0, blocks)
    values = cache.view(torch.uint8).index_select(0, blocks).view(cache.dtype)
    return kv_fp8.dequantize(values, scales.index_select(0, blocks))
