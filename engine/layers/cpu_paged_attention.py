"""Decode attention on the CPU that reads K/V in place from the paged cache: a C++ kernel built at first use.

Why: the torch path (engine/layers/attention.py: decode_attention) gathers every sequence's blocks into a
contiguous copy, widens a bf16 copy to float32 and runs SDPA over it, so it reads and writes the context several
times; at batch 64 x 320 tokens of SmolLM2 that was 100 of a 180 ms decode step on the 2-core bench box, while the
context itself is 16 MB a layer. The kernel reads each key and value once, where it lies, and computes in float32
(bench/results/engine-speed-2026-12-04.md, "CPU").

The kernel is compiled with torch's C++ extension builder (a C++ compiler and ninja, as on the bench and CI boxes)
into torch's extension cache (~25 s, once per machine, source and torch version; `make setup` does it). Where it
cannot be built, the torch path serves, and the reason is logged once.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_suffix(".cpp")
CACHE_DTYPES = (torch.float32, torch.bfloat16)


# a build's lock older than this was left by a process killed while building (torch would wait on it forever)
_STALE_LOCK_S = 600.0


@functools.cache
def kernel() -> ModuleType | None:
    """The compiled extension, or None where it cannot be built here."""
    try:
        from torch.utils.cpp_extension import _get_build_directory, _import_module_from_library, load_inline

        # -fopenmp: at::parallel_for splits the work only where OpenMP is on; the libgomp.so.1 it links is
        # torch's, already loaded by that name, so the kernel runs on the engine thread's own OpenMP team
        flags = ["-O3", "-fopenmp"]
        if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
            flags += ["-mavx2", "-mfma"]  # the dot products and sums vectorize 8 floats wide
        source = _SOURCE.read_text()
        # the name carries what the build depends on, so a build found under it is this one: loaded without
        # torch's build lock and ninja (a node killed while holding that lock would stall every later start)
        digest = hashlib.sha256("\0".join([source, *flags, torch.__version__]).encode()).hexdigest()[:16]
        name = f"tandem_cpu_paged_attention_{digest}"
        build_dir = Path(_get_build_directory(name, verbose=False))
        if (build_dir / f"{name}.so").is_file():
            return _import_module_from_library(name, str(build_dir), True)
        lock = build_dir / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            lock.unlink(missing_ok=True)
        return load_inline(name=name, cpp_sources=source, functions=["paged_decode_attention"], extra_cflags=flags,
                           extra_ldflags=["-fopenmp"], build_directory=str(build_dir))
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: the torch path serves
        logger.warning("the CPU paged-attention kernel could not be built (%s); decode attention uses the torch "
                       "path", str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None


def serves(q: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor | None) -> bool:
    """Whether the kernel computes this decode: a CPU cache of float32 or bf16 (an FP8 cache takes the torch path),
    and the kernel built."""
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
