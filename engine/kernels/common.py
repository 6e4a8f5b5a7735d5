"""What the Triton kernels share: the online-softmax step, the device facts they size their grids by.

Importing this module imports triton; `import engine` never does (engine/kernels/backend.py imports the
kernels only when a TritonAttention is built).
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

LOG2_E = 1.0 / math.log(2.0)
# Read once, as triton itself reads it at import.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@triton.jit
def attend_tile(q, k, v, m_i, l_i, acc, allowed, qk_scale, MASKED: tl.constexpr, PRECISION: tl.constexpr,
                UPCAST: tl.constexpr):
    """One step of online softmax over a tile of keys, in the log2 domain.

    q: [M, D]; k, v: [N, D]; m_i, l_i: [M] running max and sum; acc: [M, D] float32, unnormalised.
    qk_scale already holds log2(e), so exp2 replaces exp. A row whose keys are all masked keeps
    m_i at its finite start value and adds nothing: no NaN from (-inf) - (-inf).
    UPCAST: dot in float32 (the interpreter's tl.dot multiplies bf16 operands' raw bits).
    """
    if UPCAST:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if MASKED:
        scores = tl.where(allowed, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1) * qk_scale)
    p = tl.exp2(scores * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def load_kv_tile(base, page, slot, stride_block, stride_slot, mask, MASKED: tl.constexpr):
    """Rows of a paged K or V cache: token i of the tile is at (page[i], slot[i]). base points at (head, dims)."""
    ptrs = base + page[:, None] * stride_block + slot[:, None] * stride_slot
    if MASKED:
        return tl.load(ptrs, mask=mask, other=0.0)
    else:
        return tl.load(ptrs)


# Start value of the running max: finite, so fully masked tiles leave the state unchanged.
MAX_START: tl.constexpr = tl.constexpr(-1.0e30)


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs get exact dots (the default would be tf32 on GPUs); 16-bit inputs ignore this."""
    return "ieee" if dtype == torch.float32 else "tf32"


def upcast_dots(device: torch.device) -> bool:
    """Whether tl.dot must see float32 operands: under the interpreter (every CPU launch) it mishandles bf16."""
    return INTERPRETED or device.type != "cuda"


@functools.cache
def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 1 for the CPU interpreter, where grid size buys nothing."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def pad_dim(size: int) -> int:
    """Tile width for a dimension: a power of two, at least 16 (the smallest tl.dot operand)."""
    return max(16, triton.next_power_of_2(size))


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache/v_cache must be [num_blocks, block_size, Hkv, D] views of one shape, "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
