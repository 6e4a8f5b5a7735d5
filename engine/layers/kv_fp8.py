"""The FP8 KV cache (`kv_cache_dtype="fp8"`): its format, the pool that holds it, and the plain-torch quantizer.

Format (the handshake calls it "fp8_e4m3"). Every (token, KV head) row of head_dim values is stored as
float8_e4m3fn bytes and one scale byte: the biased exponent e of a power-of-two scale 2**(e - 127), chosen per
row as the smallest power of two that brings the row's largest magnitude to at most 448 (e4m3's largest finite
value). Stored value = round_to_e4m3(x / scale); read value = stored * scale.

Why per row, and why a power of two (vLLM's default is one scale of 1.0 per layer, from the checkpoint or 1.0):
- Nothing saturates and no calibration is needed: a row's scale follows its own values, whatever the model, the
  layer or the prompt. One static scale per layer either clips outliers or, set for them, pushes small values into
  e4m3's subnormals; a scale computed from the first batch would be wrong for later ones.
- It is exact and portable: dividing by a power of two is exact in float32, so the stored bytes depend only on the
  row and e4m3's round-to-nearest-even. The Triton kernel and the torch twin store the same bytes on a CPU and a
  GPU, and a prefill node and a decode node agree without exchanging anything.
- The scales travel with the blocks by construction: they live inside each block (below), so a transfer, the
  prefix cache and the KV checksum see them as part of the block's bytes.
- It costs one byte per row (head_dim 128: 0.8% more than the e4m3 values alone), and its precision is e4m3's
  relative step (2**-3 between neighbours, at most 2**-4 error) for every row's large values. A power of two keeps
  each value's mantissa, so wherever vLLM's scale of 1.0 neither saturates (> 448) nor goes subnormal (< 2**-6)
  both store the same e4m3 digits; they differ only where 1.0 clips or loses precision.

Pool: one uint8 tensor [num_blocks, num_kv_heads, num_layers, 2 (k, v), region_bytes], head-outermost like the
16-bit pool (engine/layers/attention.py), so one KV head of a block, all layers, values and scales together, is
one contiguous head unit (what a tensor-parallel rank holds and a node of another TP size pulls). A region (one
KV head's K or V of one layer in one block) holds the e4m3 values [block_size, head_dim], then, at a 16-byte
aligned offset, their scale exponents [block_size]; regions are padded to 16 bytes so every e4m3 row starts
aligned for vector loads. The layers see strided views: values [num_blocks, block_size, Hkv, D] (float8_e4m3fn)
and scales [num_blocks, block_size, Hkv] (uint8), the same indexing as a 16-bit cache's K/V views.
"""

from __future__ import annotations

import torch

from engine.host_memory import pool_zeros

FP8_DTYPE = torch.float8_e4m3fn
FP8_LAYOUT_NAME = "fp8_e4m3"  # the KV layout's dtype field (kvtransfer/handshake.py)
FP8_MAX = 448.0
EXPONENT_BIAS = 127
_ALIGN = 16
# the scale exponent is clamped so that both the scale and its inverse are normal float32 numbers
MIN_EXPONENT, MAX_EXPONENT = 1, 253
# 448 = 1.75 * 2**8: a row whose largest magnitude has a mantissa above 1.75 needs one more power of two
_MANTISSA_OF_MAX = 0x600000


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def region_geometry(block_size: int, head_dim: int) -> tuple[int, int]:
    """(scale_offset, region_bytes) of one KV head's K or V of one layer in one block."""
    scale_offset = _round_up(block_size * head_dim, _ALIGN)
    return scale_offset, _round_up(scale_offset + block_size, _ALIGN)


def fp8_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int) -> int:
    return num_kv_heads * num_layers * 2 * region_geometry(block_size, head_dim)[1]


def allocate_fp8_pool(num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                      device: torch.device | str
                      ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """The pool and each layer's (k, v, k_scale, v_scale) views of it."""
    scale_offset, region_bytes = region_geometry(block_size, head_dim)
    storage = pool_zeros((num_blocks, num_kv_heads, num_layers, 2, region_bytes), torch.uint8, device)
    return storage, [fp8_views(storage[:, :, layer], block_size, head_dim, scale_offset)
                     for layer in range(num_layers)]


def fp8_views(layer: torch.Tensor, block_size: int, head_dim: int, scale_offset: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """layer: [num_blocks, num_kv_heads, 2, region_bytes] uint8 -> (k, v, k_scale, v_scale) views."""

    def values(kv: int) -> torch.Tensor:
        rows = layer[:, :, kv, :block_size * head_dim].view(FP8_DTYPE).unflatten(-1, (block_size, head_dim))
        return rows.transpose(1, 2)

    def scales(kv: int) -> torch.Tensor:
        return layer[:, :, kv, scale_offset:scale_offset + block_size].transpose(1, 2)

    return values(0), values(1), scales(0), scales(1)


def scale_exponents(amax: torch.Tensor) -> torch.Tensor:
    """Per-row largest magnitudes (float32, >= 0) -> the scales' biased exponents (uint8): the smallest e with
    amax / 2**(e - 127) <= 448. Integer arithmetic on the float's bits, so it is exact (the kernel does the same)."""
    bits = amax.float().view(torch.int32)
    exponent = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > _MANTISSA_OF_MAX).int()
    return exponent.clamp(MIN_EXPONENT, MAX_EXPONENT).to(torch.uint8)


def exponent_to_scale(exponents: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """2**(e - 127) (or its inverse 2**(127 - e)) as float32, built from its bits."""
    biased = exponents.int()
    if inverse:
        biased = 2 * EXPONENT_BIAS - biased
    return (biased << 23).view(torch.float32)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] -> (e4m3 values [..., D], scale exponents [...] uint8)."""
    x32 = x.float()
    exponents = scale_exponents(x32.abs().amax(dim=-1))
    scaled = x32 * exponent_to_scale(exponents, inverse=True)[..., None]
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), exponents


def dequantize(values: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """(e4m3 values [..., D], exponents [...]) -> float32 [..., D]."""
    return values.float() * exponent_to_scale(exponents)[..., None]
