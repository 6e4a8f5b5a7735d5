"""mix64: a KV block checksum a GPU computes for all blocks of a ticket in one launch.

xxh3 is sequential and lives on the host: checksumming GPU blocks with it means a device-to-host copy per block
(a 16k-token ticket of 2 MiB blocks moves 2 GB through the host). mix64 is a sum of independently mixed words,
so a GPU computes it for many blocks at memory bandwidth, and one small copy brings the results back.

The formula (all arithmetic on unsigned 64-bit integers, wrapping mod 2^64). A block of `block_bytes` bytes
(a multiple of 4) is read as `n = block_bytes / 4` little-endian 32-bit words `w[0..n)`; then

    x_i   = (i << 32) | w[i]                       # i: the word's position, 0 <= i < 2^32
    x_i  ^= x_i >> 30;  x_i *= 0xBF58476D1CE4E5B9  # the splitmix64 finaliser: a bijection of 64-bit values
    x_i  ^= x_i >> 27;  x_i *= 0x94D049BB133111EB
    x_i  ^= x_i >> 31
    sum   = x_0 + x_1 + ... + x_{n-1}  (mod 2^64)

and the checksum string is `f"mix64:{sum:016x}"`. Why it catches what it must:
- `(i << 32) | w` is one-to-one in (i, w) and the finaliser is a bijection, so changing one word (any flipped
  byte or bytes within it) changes exactly one term, hence the sum: always, not with high probability.
- Each word's term depends on its position, so swapped or shifted words change the sum (unless the mixed
  values collide, about 2^-64); blocks swapped in a ticket change its per-block checksums (unless equal).
- Addition mod 2^64 is associative and commutative: any split into chunks and any reduction order gives
  the same bits, so the GPU result is deterministic and equals the CPU one.

A checksum of several blocks together (`kv_checksum(region, ids, "mix64")`) is the same formula over their
concatenation: block k's word i sits at position `k * n + i` (the positions must stay below 2^32).

Two implementations: a Triton kernel for CUDA tensors (kvtransfer/gpu_checksum_kernels.py, imported only
then) and a torch twin (pure torch integer ops on int64, chunked to bound memory) for CPU tensors, and for
CUDA when triton is missing. torch is imported lazily: `import kvtransfer` stays torch-free.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtransfer.base import KVRegion, MemoryKind
from kvtransfer.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

MIX64_MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
MIX64_SHIFTS = (30, 27, 31)
MASK64 = (1 << 64) - 1
MAX_POSITIONS = 1 << 32  # word positions live in the high half of x
TWIN_CHUNK_WORDS = 1 << 20  # the twin's working set: a few int64 temporaries of this many words (8 MiB each)


def pool_words(region: KVRegion) -> torch.Tensor:
    """The region as int32 words `[num_blocks, block_bytes // 4]`, without a copy (host or GPU memory)."""
    import torch

    if region.block_bytes % 4:
        raise InvalidRequestError(f"mix64 needs blocks of a multiple of 4 bytes, got {region.block_bytes}")
    block_words = region.block_bytes // 4
    if region.memory_kind is MemoryKind.DRAM:
        # through the address, like the host checksums: the owner may be a numpy array, a tensor or nothing
        buffer = (ctypes.c_ubyte * region.num_bytes).from_address(region.base_address)
        return torch.frombuffer(buffer, dtype=torch.int32).view(region.num_blocks, block_words)
    owner = region.owner
    if owner is None or not hasattr(owner, "data_ptr"):
        raise InvalidRequestError("a checksum of GPU blocks needs the region's owning tensor")
    if owner.data_ptr() != region.base_address or owner.numel() * owner.element_size() != region.num_bytes:
        raise InvalidRequestError("the region's owning tensor does not cover exactly the region")
    return owner.reshape(-1).view(torch.uint8).view(torch.int32).view(region.num_blocks, block_words)


def mix64_block_sums(words: torch.Tensor, block_ids: Sequence[int], *, concatenated: bool = False) -> list[int]:
    """mix64 of each block `block_ids[k]` of `words` ([num_blocks, block_words] int32), as ints in [0, 2^64).

    With `concatenated`, block k's words sit at positions `k * block_words + i` (their sum mod 2^64 is then
    the checksum of the blocks' concatenation). CUDA tensors: two Triton launches and one device-to-host copy
    of `len(block_ids)` int64; CPU tensors: the torch twin."""
    import torch

    num_blocks, block_words = words.shape
    ids = [int(b) for b in block_ids]
    if any(b < 0 or b >= num_blocks for b in ids):
        raise InvalidRequestError(f"checksum block ids must be in [0, {num_blocks})")
    position_stride = block_words if concatenated else 0
    if max(len(ids) * position_stride, block_words) > MAX_POSITIONS:
        raise InvalidRequestError(f"mix64 covers at most {MAX_POSITIONS} words (16 GiB) in one checksum")
    if not ids:
        return []
    ids_tensor = torch.tensor(ids, dtype=torch.int64, device=words.device)
    sums = None
    if words.is_cuda:
        try:
            from kvtransfer.gpu_checksum_kernels import mix64_sums_triton
        except ImportError:  # pragma: no cover - GPU images bring triton; the twin is correct, only slower
            logger.warning("triton is not importable: mix64 checksums of GPU blocks use the torch twin")
        else:
            with torch.cuda.device(words.device):
                sums = mix64_sums_triton(words, ids_tensor, position_stride)
    if sums is None:
        sums = mix64_sums_torch(words, ids_tensor, position_stride)
    return [value & MASK64 for value in sums.cpu().tolist()]


def mix64_sums_torch(words: torch.Tensor, block_ids: torch.Tensor, position_stride: int = 0,
                     chunk_words: int = TWIN_CHUNK_WORDS) -> torch.Tensor:
    """The torch twin: int64 [len(block_ids)] of mix64 sums (bit patterns of the uint64 results).

    torch has no full uint64 arithmetic, so this runs on int64, whose +, * and << wrap mod 2^64 exactly like
    uint64 (same bits); only `>>` differs (it copies the sign bit), so each right shift masks off the copies.
    At most `chunk_words` words are in flight at a time."""
    import torch

    num_slots, block_words = len(block_ids), words.shape[1]
    sums = torch.zeros(num_slots, dtype=torch.int64, device=words.device)
    rows_per_step = max(1, chunk_words // block_words)
    columns_per_step = min(block_words, chunk_words)
    multipliers = [_as_int64(m) for m in MIX64_MULTIPLIERS]
    for row in range(0, num_slots, rows_per_step):
        rows = block_ids[row:row + rows_per_step]
        slots = torch.arange(row, row + len(rows), dtype=torch.int64, device=words.device)
        for column in range(0, block_words, columns_per_step):
            end = min(column + columns_per_step, block_words)
            positions = torch.arange(column, end, dtype=torch.int64, device=words.device)
            positions = slots[:, None] * position_stride + positions[None, :]  # [rows, columns]
            x = (positions << 32) | (words[rows, column:end].to(torch.int64) & 0xFFFFFFFF)
            x ^= _shift_right(x, MIX64_SHIFTS[0])
            x *= multipliers[0]
            x ^= _shift_right(x, MIX64_SHIFTS[1])
            x *= multipliers[1]
            x ^= _shift_right(x, MIX64_SHIFTS[2])
            sums[row:row + len(rows)] += x.sum(dim=1)
    return sums


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The logical (unsigned) right shift of int64 bit patterns."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _as_int64(value: int) -> int:
    """The int64 with the bits of the uint64 `value`."""
    return value - (1 << 64) if value >= 1 << 63 else value
