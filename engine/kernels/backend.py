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
# Fresh prompts of one length (a multiple of the bucket) side by side in a step are attended in one call, in
# batches of 2, 4, 8... sequences up to this many tokens: one call per prompt ran at 63-256 TFLOP/s for 8 x 1024 to
# 4 x 2048 tokens on the H200 (its launches and the copies around it), one call for all at 391-477
# (bench/h200/dense_batch_probe.py). Powers of two bound the shapes warm_up plans to ~2 per length.
DENSE_BATCH_MAX_TOKENS = 8192
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
        self._plan: tuple[AttentionMetadata, DensePlan] | None = None  # the step's plan, made at its first layer

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
        # every layer of a step sees the same metadata: its plan is made once, at the first layer
        if self._plan is None or self._plan[0] is not meta:
            self._plan = (meta, plan_dense_batches(meta, dense_from))
        dense, paged_query_lens = self._plan[1]
        if len(dense) == 1 and not num_decodes and not paged_query_lens:
            # the step is these prompts (a long prompt usually is): their result is the output, no copy
            return dense_causal_attention(q, k, v, scale, dense[0][1] - dense[0][0])
        out = torch.empty_like(q)
        if num_decodes:
            self._decode(q[:num_decodes], k_cache, v_cache, meta.block_tables[:num_decodes],
                         meta.seq_lens[:num_decodes], scale, meta.sliding_window, out=out[:num_decodes],
                         k_scale=k_scale, v_scale=v_scale)
        starts = meta.query_start_loc_host
        for first, stop in dense:
            rows = slice(starts[first], starts[stop])
            out[rows] = dense_causal_attention(q[rows], k[rows], v[rows], scale, stop - first)
        if paged_query_lens:
            # the prefill kernel indexes q and out by query_start_loc itself: the decode rows and the densely
            # attended prompts' rows stay untouched
            self._prefill(q, k_cache, v_cache, meta.block_tables[num_decodes:],
                          meta.query_start_loc[num_decodes:], meta.seq_lens[num_decodes:], scale,
                          meta.sliding_window, out=out, max_query_len=max(paged_query_lens),
                          dense_from=dense_from, k_scale=k_scale, v_scale=v_scale)
        return out

    def warm_up(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                max_prompt_tokens: int, max_step_tokens: int) -> None:
        """Plans the dense attention of every padded length a prompt of one step can have, and of every batch of
        prompts that forward() attends in one call."""
        if not self.dense_prefill_min_tokens or device.type != "cuda" or dtype not in _DENSE_DTYPES:
            return
        first = dense_length(self.dense_prefill_min_tokens)
        for length in range(first, dense_length(max_prompt_tokens) + 1, DENSE_LENGTH_BUCKET):
            batch = 1
            while batch == 1 or batch * length <= min(DENSE_BATCH_MAX_TOKENS, max_step_tokens):
                q = torch.zeros(batch * length, num_heads, head_dim, dtype=dtype, device=device)
                kv = torch.zeros(batch * length, num_kv_heads, head_dim, dtype=dtype, device=device)
                dense_causal_attention(q, kv, kv, head_dim ** -0.5, batch)
                batch *= 2

    def _dense_from(self, q: torch.Tensor, meta: AttentionMetadata) -> int:
        """The dense path's threshold for this step, 0 when it does not apply (CPU, float32, sliding window)."""
        if q.device.type != "cuda" or q.dtype not in _DENSE_DTYPES or meta.sliding_window is not None:
            return 0
        return self.dense_prefill_min_tokens


# (first, stop) sequence ranges attended densely, one call each; the query lengths of the other prompt sequences
DensePlan = tuple[list[tuple[int, int]], list[int]]


def plan_dense_batches(meta: AttentionMetadata, dense_from: int) -> DensePlan:
    """Which of the step's prompt sequences the dense path takes (dense_from: its threshold, 0 for none), as runs
    of fresh prompts of one length that needs no padding, in batches of 2, 4, 8... up to DENSE_BATCH_MAX_TOKENS;
    a padded length is a run of its own."""
    starts, seq_lens = meta.query_start_loc_host, meta.seq_lens_host

    def fresh_length(b: int) -> int:  # a fresh prompt's length (its whole context is new), else 0
        length = starts[b + 1] - starts[b]
        return length if dense_from and length == seq_lens[b] and length >= dense_from else 0

    dense: list[tuple[int, int]] = []
    paged_query_lens: list[int] = []
    b = meta.num_decodes
    while b < meta.num_seqs:
        length = fresh_length(b)
        if not length:
            paged_query_lens.append(starts[b + 1] - starts[b])
            b += 1
            continue
        batch = 1
        if dense_length(length) == length:
            while (b + 2 * batch <= meta.num_seqs and 2 * batch * length <= DENSE_BATCH_MAX_TOKENS
                   and all(fresh_length(c) == length for c in range(b + batch, b + 2 * batch))):
                batch *= 2
        dense.append((b, b + batch))
        b += batch
    return dense, paged_query_lens


def dense_length(num_tokens: int) -> int:
    return -(-num_tokens // DENSE_LENGTH_BUCKET) * DENSE_LENGTH_BUCKET


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                           num_seqs: int = 1) -> torch.Tensor:
    """Causal attention of `num_seqs` sequences of one length, packed one after another, each over its own K/V.
    q: [num_seqs * T, Hq, D]; k, v: [num_seqs * T, Hkv, D] (any row stride: views of the fused qkv projection
    are fine) -> [num_seqs * T, Hq, D]. Several sequences only at a length that needs no padding."""
    length = q.shape[0] // num_seqs
    padded = dense_length(length)
    # cuDNN's plans are keyed on the strides too: every call passes contiguous [sequences, tokens, heads, D], the
    # layout warm_up plans. The rotary kernel's q and k already are (no copy); v, a view of the fused projection,
    # is copied (a quarter of q's bytes)
    if padded == length:
        q, k, v = (x.contiguous().unflatten(0, (num_seqs, length)) for x in (q, k, v))
    else:
        assert num_seqs == 1, "only a length that needs no padding is batched"
        padding = (0, 0, 0, 0, 0, padded - length)
        q, k, v = (F.pad(x, padding)[None] for x in (q, k, v))
    # cuDNN first, then flash: torch's own order may change between versions, and on the H200 flash (FA2)
    # runs at half of cuDNN's rate here (bench/h200/prefill_probe.py)
    with sdpa_kernel(_DENSE_BACKENDS, set_priority=True):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, scale=scale, enable_gqa=True)
    # cuDNN writes its output in q's layout: back to [tokens, heads, D] without a copy
    return out.transpose(1, 2)[:, :length].flatten(0, 1)
