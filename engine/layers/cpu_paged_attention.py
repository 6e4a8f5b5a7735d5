"""Decode attention on the CPU that reads K/V in place from the paged cache: a C++ kernel built at first use.

Why: the torch path (engine/layers/attention.py: decode_attention) gathers every sequence's blocks into a
contiguous copy, widens a bf16 copy to float32 and runs SDPA over it, so it reads and writes the context several
times; at batch 64 x 320 tokens of SmolLM2 that was 100 of a 180 ms decode step on the 2-core bench box, while the
context itself is 16 MB a layer. The kernel reads each key and value once, where it lies, and computes in float32
(bench/results/engine-speed-2026-12-04.md, "CPU").

The kernel is built with the CPU path's other C++ kernels (engine/layers/cpu_kernels.py); where they cannot be
built, the torch path serves.
"""

from __future__ import annotations

import torch

from engine.layers.cpu_kernels import kernel

CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def serves(q: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor | None) -> bool:
    """Whether the kernel computes this decode: a CPU cache of float32, bf16 or fp16 (an FP8 cache takes the torch
    path), and the kernel built."""
    return (q.device.type == "cpu" and k_scale is None and k_cache.dtype in CACHE_DTYPES
            and k_cache.stride(-1) == 1 and kernel() is not None)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           sliding_window: int | None) -> torch.Tensor:
    """q: [B, Hq, D], one query per sequence -> [B, Hq, D] in q's dtype (computed in float32)."""
    module = kernel()
    assert module is not None, "serves() says whether the kernel is there"
    out = module.paged_decode_attention(q.float().contiguous(), k_cache, v_cache, block_tables.to(torch.int32),
                                        seq_lens.to(torch.int32), scale, sliding_window or 0)
    return out.to(q.dtype)
