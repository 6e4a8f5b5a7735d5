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
                UPCAST: tl.constexpr, k_scale, v_scale, FP8: tl.constexpr):
    """One step of online softmax over a tile of keys, in the log2 domain.

    q: [M, D]; k, v: [N, D]; m_i, l_i: [M] running max and sum; acc: [M, D] float32, unnormalised.
    qk_scale already holds log2(e), so exp2 replaces exp. A row whose keys are all masked keeps
    m_i at its finite start value and adds nothing: no NaN from (-inf) - (-inf).
    UPCAST: dot in float32 (the interpreter's tl.dot multiplies bf16 operands' raw bits).
    FP8: k and v are e4m3 with per-key scales k_scale, v_scale [N] (float32): the values are widened to q's dtype
    (exact: e4m3 fits in bf16) and the scales applied to the scores and the probabilities, N*M products instead of
    the N*D a dequantized tile would cost.
    """
    if UPCAST:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    elif FP8:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if FP8:
        scores = scores * k_scale[None, :]
    if MASKED:
        scores = tl.where(allowed, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1) * qk_scale)
    p = tl.exp2(scores * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP8:
        weights = p * v_scale[None, :]
    else:
        weights = p
    acc = tl.dot(weights.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def load_kv_tile(base, page, slot, stride_block, stride_slot, mask, MASKED: tl.constexpr):
    """Rows of a paged K or V cache: token i of the tile is at (page[i], slot[i]). base points at (head, dims)."""
    ptrs = base + page[:, None] * stride_block + slot[:, None] * stride_slot
    if MASKED:
        return tl.load(ptrs, mask=mask, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def fp8_scale_exponent(amax):
    """Per-row largest magnitudes (float32, >= 0) -> the biased exponent e (int32) of the smallest power-of-two
    scale 2**(e - 127) that brings them to at most 448 (engine/layers/kv_fp8.py: same integer arithmetic)."""
    bits = amax.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    return tl.minimum(tl.maximum(exponent, 1), 253)


@triton.jit
def fp8_scale(exponent):
    """2**(e - 127) as float32, from a scale exponent (uint8 or int32)."""
    return (exponent.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def round_to_e4m3(x):
    """x (float32, |x| <= 448) rounded to the nearest e4m3 value, ties to even, still in float32, so the cast to
    float8e4nv after it is exact. The interpreter's own cast loses a carry into the exponent (31.3 -> 16); on a GPU
    this only repeats what the hardware conversion does. The grid step near x is 2**(max(exp(x), -6) - 3); adding
    and subtracting 1.5 * 2**23 steps rounds to a multiple of it in float32's own round-to-nearest-even."""
    biased = (x.to(tl.int32, bitcast=True) >> 23) & 0xFF
    step = ((tl.maximum(biased, 127 - 6) - 3) << 23).to(tl.float32, bitcast=True)
    magic = step * 12582912.0
    rounded = (x + magic) - magic
    # a value that rounds to zero keeps its sign, as torch's cast does (-1e-6 -> -0.0, byte 0x80): (x + magic) -
    # magic gives +0.0 whatever the sign; every other result already has x's sign bit
    sign = x.to(tl.int32, bitcast=True) & -2147483648
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def load_scale_tile(base, page, slot, stride_block, stride_slot, mask, MASKED: tl.constexpr, FP8: tl.constexpr):
    """The float32 scales of a tile's FP8 rows (see load_kv_tile); 1.0 (unread) without FP8."""
    if FP8:
        ptrs = base + page * stride_block + slot * stride_slot
        if MASKED:
            return fp8_scale(tl.load(ptrs, mask=mask, other=127))
        else:
            return fp8_scale(tl.load(ptrs))
    else:
        return tl.full(page.shape, 1.0, tl.float32)


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


def fp8_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
               ) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """(fp8, k_scale, v_scale) to launch with: the scale views of an FP8 cache (float8_e4m3fn values and
    [num_blocks, block_size, Hkv] uint8 exponents), or, for a 16/32-bit cache, stand-ins the kernels never read."""
    if k_scale is None and v_scale is None:
        stand_in = k_cache[..., 0]
        return False, stand_in, stand_in
    if k_scale is None or v_scale is None or k_cache.dtype != torch.float8_e4m3fn:
        raise ValueError(f"an FP8 cache needs float8_e4m3fn values and both scales, got a {k_cache.dtype} cache "
                         f"with k_scale {k_scale is not None}, v_scale {v_scale is not None}")
    for scale in (k_scale, v_scale):
        if scale.shape != k_cache.shape[:3] or scale.dtype != torch.uint8:
            raise ValueError(f"FP8 scales must be [num_blocks, block_size, Hkv] uint8 ({tuple(k_cache.shape[:3])}), "
                             f"got {scale.dtype} {tuple(scale.shape)}")
    return True, k_scale, v_scale
