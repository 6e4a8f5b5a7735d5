"""Plain-torch twins of the Triton kernels: slow, obvious, and the oracle the kernel tests compare against.

Same signatures and the same cache layout as the kernels (see engine/layers/attention.py):
k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], strided views of one tensor.
Attention math runs in float32 whatever the input dtype; outputs come back in the input dtype.
An FP8 cache comes with k_scale, v_scale: [num_blocks, block_size, num_kv_heads] uint8 scale exponents
(engine/layers/kv_fp8.py); the twins quantize and dequantize with kv_fp8's torch functions.
"""

from __future__ import annotations

import torch

from engine.layers import kv_fp8


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """k, v: [T, Hkv, D] -> the cache slots in slot_mapping [T] (negative slots are padding and skipped)."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    if k_scale is None or v_scale is None:
        k_cache[blocks, offsets] = k[keep]
        v_cache[blocks, offsets] = v[keep]
        return
    for rows, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        values, exponents = kv_fp8.quantize(rows[keep])
        cache.view(torch.uint8)[blocks, offsets] = values.view(torch.uint8)
        scales[blocks, offsets] = exponents


def _context(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int,
             scales: torch.Tensor | None = None) -> torch.Tensor:
    """The first num_tokens of one sequence as float32: [num_tokens, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    blocks = block_table[:num_blocks].long()
    if scales is None:
        return cache[blocks].flatten(0, 1)[:num_tokens].float()
    values = cache.view(torch.uint8)[blocks].view(cache.dtype).flatten(0, 1)[:num_tokens]
    return kv_fp8.dequantize(values, scales[blocks].flatten(0, 1)[:num_tokens])


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_pos: torch.Tensor,
            scale: float, sliding_window: int | None) -> torch.Tensor:
    """q: [Tq, Hq, D] at positions query_pos [Tq]; keys/values: [L, Hkv, D] at positions 0..L-1."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
    key_pos = torch.arange(keys.shape[0], device=q.device)
    allowed = key_pos[None, :] <= query_pos[:, None]
    if sliding_window is not None:
        allowed &= query_pos[:, None] - key_pos[None, :] < sliding_window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values).to(q.dtype)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           sliding_window: int | None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, Hq, D], one query per sequence at position seq_lens[b] - 1 -> [B, Hq, D]."""
    out = torch.empty_like(q)
    for b, seq_len in enumerate(seq_lens.tolist()):
        keys = _context(k_cache, block_tables[b], seq_len, k_scale)
        values = _context(v_cache, block_tables[b], seq_len, v_scale)
        query_pos = torch.tensor([seq_len - 1], device=q.device)
        out[b:b + 1] = _attend(q[b:b + 1], keys, values, query_pos, scale, sliding_window)
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, sliding_window: int | None,
                            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None
                            ) -> torch.Tensor:
    """q: [T, Hq, D]; sequence b's queries are rows [start[b], start[b+1]), the last tokens of its context."""
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        rows = slice(starts[b], starts[b + 1])
        num_queries = starts[b + 1] - starts[b]
        keys = _context(k_cache, block_tables[b], seq_len, k_scale)
        values = _context(v_cache, block_tables[b], seq_len, v_scale)
        query_pos = torch.arange(seq_len - num_queries, seq_len, device=q.device)
        out[rows] = _attend(q[rows], keys, values, query_pos, scale, sliding_window)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """transformers' RMSNorm; with residual, first residual = x + residual (in x's dtype) and return both."""
    if residual is not None:
        residual = x + residual
        x = residual
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = (weight * normed).to(x.dtype)
    return out if residual is None else (out, residual)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE. positions: [T]; q: [T, Hq, D]; k: [T, Hkv, D]; cos_sin_cache: [max_pos, D] float32."""
    cos, sin = cos_sin_cache[positions.long()].chunk(2, dim=-1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        # transformers casts cos/sin to the activations' dtype before multiplying
        c = cos[:, None, :].to(x.dtype)
        s = sin[:, None, :].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    return rotate(q), rotate(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2*I] (gate then up) -> [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, expert_start: int = 0) -> torch.Tensor:
    """Routed experts, one at a time, as transformers runs them.

    x: [T, H]; w13: [E, 2I, H] (each expert's gate rows, then its up rows); w2: [E, H, I];
    topk_weights, topk_ids: [T, K]. This rank holds experts expert_start .. expert_start + E - 1: a pair routed
    to any other expert adds nothing. Each pair's output is scaled by its weight and the K of a token summed
    in float32 -> [T, H] in x's dtype."""
    num_local = w13.shape[0]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    local_ids = topk_ids.long() - expert_start
    for expert in local_ids.unique().tolist():
        if not 0 <= expert < num_local:
            continue
        token_idx, k_idx = torch.where(local_ids == expert)
        gate_up = x[token_idx] @ w13[expert].t()
        expert_out = silu_and_mul(gate_up) @ w2[expert].t()
        out.index_add_(0, token_idx, expert_out.float() * topk_weights[token_idx, k_idx, None].float())
    return out.to(x.dtype)
