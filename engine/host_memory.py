"""Host tensors on transparent huge pages.

The CPU KV pool is read in scattered runs: a block's K and V of one layer and KV head (4 KiB for SmolLM2) lie
next to each other, and the next block's a pool stride away (~200 KiB), so with 4 KiB pages each block the decode
kernel walks (cpu_paged_attention.cpp) is on a page of its own, a TLB miss. On 2 MiB pages its decode attention at
batch 64 took 8% (SmolLM2's shape) to 25% (the 125M bench model's) less time, and the offline runs gained 5-13%
(bench/results/engine-speed-2026-12-05.md).

Most Linux hosts run transparent huge pages in "madvise" mode: only memory marked MADV_HUGEPAGE gets them, so
the pools (16/32-bit and FP8) are marked before their first touch. Where the kernel has them off, or on another
OS, a pool keeps ordinary pages; nothing else changes.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_MADV_HUGEPAGE = 14  # linux/mman.h
_THP_SIZE = Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")


def huge_page_bytes() -> int | None:
    """The transparent huge page size, None where this kernel has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return int(_THP_SIZE.read_text())
    except (OSError, ValueError):
        return None


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Marks the whole huge pages inside a host tensor's memory MADV_HUGEPAGE; whether the kernel took it. Only
    pages not yet touched get huge pages at their first fault: call it on a fresh `torch.empty`."""
    size = huge_page_bytes()
    if size is None or tensor.device.type != "cpu":
        return False
    start = tensor.untyped_storage().data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    first, last = -(-start // size) * size, end // size * size  # the huge pages wholly inside
    if last <= first:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(first, last - first, _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
        return False
    return True


def pool_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed KV pool: on the host on transparent huge pages where the kernel gives them, on a GPU as it is."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    tensor = torch.empty(shape, dtype=dtype)
    advise_huge_pages(tensor)
    return tensor.zero_()
