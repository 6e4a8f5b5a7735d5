"""TritonAttention: the AttentionBackend on Triton kernels (GPU, or the CPU interpreter under TRITON_INTERPRET=1).

Triton is imported when a TritonAttention is built, not when this module is imported, so choosing the
torch backend never needs triton installed.
"""

from __future__ import annotations

import torch

from engine.layers.attention import AttentionBackend, AttentionMetadata


class TritonAttention(AttentionBackend):
    """Same contract as TorchAttention: store the step's K/V, then decodes batched, then prefill chunks.

    The decode kernel's launch shape depends only on tensor shapes (no host values), so the decode part can
    be captured in a CUDA graph; the prefill part uses the host metadata to size its grid.
    """

    def __init__(self) -> None:
        from engine.kernels import decode, kv_store, prefill

        self._store_kv = kv_store.store_kv
        self._decode = decode.paged_decode_attention
        self._prefill = prefill.paged_prefill_attention

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self._store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        num_decodes = meta.num_decodes
        if num_decodes:
            self._decode(q[:num_decodes], k_cache, v_cache, meta.block_tables[:num_decodes],
                         meta.seq_lens[:num_decodes], scale, meta.sliding_window, out=out[:num_decodes])
        if meta.num_seqs > num_decodes:
            starts = meta.query_start_loc_host
            max_query_len = max(starts[b + 1] - starts[b] for b in range(num_decodes, meta.num_seqs))
            # the prefill kernel indexes q and out by query_start_loc itself: the decode rows stay untouched
            self._prefill(q, k_cache, v_cache, meta.block_tables[num_decodes:],
                          meta.query_start_loc[num_decodes:], meta.seq_lens[num_decodes:], scale,
                          meta.sliding_window, out=out, max_query_len=max_query_len)
        return out
