"""TritonAttention: the AttentionBackend on Triton kernels (GPU, or the CPU interpreter under TRITON_INTERPRET=1).

Triton is imported when a TritonAttention is built, not when this module is imported, so choosing the
torch backend never needs triton installed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.layers.attention import AttentionBackend, AttentionMetadata

# A fresh prompt (no cached prefix) of at least this many tokens, in 16-bit on a GPU, is attended over the
# step's own dense K/V by torch's fused SDPA instead of the paged kernel: on the H200 its cuDNN kernel runs causal
# attention at head dim 128 well above what the paged Triton kernel reaches (bench/h200/prefill_probe.py;
# bench/results/engine-speed-*.md). Shorter prompts stay in the one paged launch, where a launch per sequence
# would cost more than it saves.
DENSE_PREFILL_MIN_TOKENS = 1024
# cuDNN builds an execution plan for every new sequence length (~40 ms on the H200, bench/h200/sdpa_first_call.py):
# dense prompts are padded at the end to a multiple of this, so a server plans a bounded set of lengths, all at
# start-up (TritonAttention.warm_up). Under the causal mask the real rows never see the padding keys.
DENSE_LENGTH_BUCKET = 256
_DENSE_DTYPES = (torch.bfloat16, torch.float16)
_DENSE_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                   SDPBackend.MATH]


class TritonAttention(AttentionBackend):
    """Same contract as TorchAttention: store the step's K/V, then decodes batched, then prefill chunks.

    The decode kernel's launch shape depends only on tensor shapes (no host values), so the decode part can
    be captured in a CUDA graph; the prefill part uses the host metadata to size its grid.
    """

    def __init__(self, dense_prefill_min_tokens: int = DENSE_PREFILL_MIN_TOKENS) -> None:
        from engine.kernels import decode, kv_store, prefill

        self._store_kv = kv_store.store_kv
        self._decode = decode.paged_decode_attention
        self._prefill = prefill.paged_prefill_attention
        self.dense_prefill_min_tokens = dense_prefill_min_tokens  # 0: never

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                kv_stored: bool = False) -> torch.Tensor:
        # With an FP8 cache (k_scale, v_scale) the paged kernels read e4m3 K/V; a fresh prompt attended densely
        # uses the step's own K/V, before quantization, as it never reads the cache
        if not kv_stored:
            self._store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        num_decodes = meta.num_decodes
        dense_from = self._dense_from(q, meta)
        starts = meta.query_start_loc_host

        def is_dense(b: int) -> bool:  # a fresh prompt (its whole context is new) long enough for SDPA
            num_queries = starts[b + 1] - starts[b]
            return bool(dense_from) and num_queries == meta.seq_lens_host[b] and num_queries >= dense_from

        if meta.num_seqs == 1 and not num_decodes and is_dense(0):
            # one fresh prompt is the whole step (a long prompt usually is): its result is the output, no copy
            return dense_causal_attention(q, k, v, scale)
        out = torch.empty_like(q)
        if num_decodes:
            self._decode(q[:num_decodes], k_cache, v_cache, meta.block_tables[:num_decodes],
                         meta.seq_lens[:num_decodes], scale, meta.sliding_window, out=out[:num_decodes],
                         k_scale=k_scale, v_scale=v_scale)
        if meta.num_seqs > num_decodes:
            paged_query_lens = []
            for b in range(num_decodes, meta.num_seqs):
                rows = slice(starts[b], starts[b + 1])
                if is_dense(b):
                    out[rows] = dense_causal_attention(q[rows], k[rows], v[rows], scale)
                else:
                    paged_query_lens.append(rows.stop - rows.start)
            if paged_query_lens:
                # the prefill kernel indexes q and out by query_start_loc itself: the decode rows and the
                # densely attended prompts' rows stay untouched
                self._prefill(q, k_cache, v_cache, meta.block_tables[num_decodes:],
                              meta.query_start_loc[num_decodes:], meta.seq_lens[num_decodes:], scale,
                              meta.sliding_window, out=out, max_query_len=max(paged_query_lens),
                              dense_from=dense_from, k_scale=k_scale, v_scale=v_scale)
        return out

    def warm_up(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                max_prompt_tokens: int) -> None:
        """Plans the dense attention of every padded length a prompt of one step can have."""
        if not self.dense_prefill_min_tokens or device.type != "cuda" or dtype not in _DENSE_DTYPES:
            return
        first = dense_length(self.dense_prefill_min_tokens)
        for length in range(first, dense_length(max_prompt_tokens) + 1, DENSE_LENGTH_BUCKET):
            q = torch.zeros(length, num_heads, head_dim, dtype=dtype, device=device)
            kv = torch.zeros(length, num_kv_heads, head_dim, dtype=dtype, device=device)
            dense_causal_attention(q, kv, kv, head_dim ** -0.5)

    def _dense_from(self, q: torch.Tensor, meta: AttentionMetadata) -> int:
        """The dense path's threshold for this step, 0 when it does not apply (CPU, float32, sliding window)."""
        if q.device.type != "cuda" or q.dtype not in _DENSE_DTYPES or meta.sliding_window is not None:
            return 0
        return self.dense_prefill_min_tokens


def dense_length(num_tokens: int) -> int:
    return -(-num_tokens // DENSE_LENGTH_BUCKET) * DENSE_LENGTH_BUCKET


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one whole sequence over its own K/V. q: [T, Hq, D]; k, v: [T, Hkv, D] (any row
    stride: views of the fused qkv projection are fine) -> [T, Hq, D]."""
    num_tokens = q.shape[0]
    # always a padded contiguous copy (a few MB against the attention's compute): cuDNN's plans are keyed on the
    # strides too, and one layout per length is what warm_up plans
    padding = (0, 0, 0, 0, 0, dense_length(num_tokens) - num_tokens)
    q, k, v = (F.pad(x, padding) for x in (q, k, v))
    # cuDNN first, then flash: torch's own order may change between versions, and on the H200 flash (FA2)
    # runs at half of cuDNN's rate here (bench/h200/prefill_probe.py)
    with sdpa_kernel(_DENSE_BACKENDS, set_priority=True):
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], is_causal=True, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)[:num_tokens]
