"""The MLP's gate_up projection with SiLU-and-mul fused into its epilogue, on Hopper GPUs (hopper_mlp.cu).

A split-K down_proj kernel was removed after losing to cuBLAS on an H100 (0.74x at M=64, 0.81x at 128, 1.03x at
256, 0.94x at 512; o_proj 0.97x): the down projection stays F.linear (cuBLAS). Do not re-add it without a win.

At decode batches of 64-512 the gate_up GEMM is (nearly) compute-bound, and cuBLAS's GEMM followed by the
SiLU-and-mul kernel writes and re-reads the [M, 2I] product; the fused kernel writes only [M, I] and runs the whole
projection 1.03-1.17x faster on an H100 (bench/h200/hopper_mlp_probe.py), with bit-equal outputs there. The CUDA
source is built with nvcc at first use into a per-user cache and called through ctypes (no torch C++ extension, so
no ABI to match); where it cannot be built or loaded (`device_supported`, asked once) or the shape is not one it
takes (`shape_supported`, asked per step), the caller keeps F.linear + SiLU-and-mul.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("hopper_mlp.cu")
HEADERS = [Path(__file__).with_name("hopper_ptx.cuh")]
BLOCK_K = 64  # the kernel's K block
HALF_TILE = 112  # gate (and up) rows a tile takes
# The row counts it was measured to win at against cuBLAS + SiLU-and-mul (bench/h200/hopper_mlp_probe.py, H100:
# 1.03x at 64, 1.07x at 128, 1.17x at 256, 1.03x at 512; even at 1024, 0.98x at 2048-4096, 0.90x at 8192, where
# cuBLAS's larger tiles win): decode batches, not prompt steps
MIN_ROWS, MAX_ROWS = 64, 512

_library: ctypes.CDLL | None = None
_load_failed = False


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


def _build(nvcc: str) -> Path:
    """The shared library for this source and compiler, built once per user (atomic rename: concurrent builders,
    e.g. tensor-parallel workers, each write their own file and the last rename wins)."""
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    sources = b"".join(path.read_bytes() for path in [SOURCE, *HEADERS])
    key = hashlib.sha256(sources + version.encode()).hexdigest()[:16]
    cache = Path.home() / ".cache" / "tandem" / "kernels"
    target = cache / f"hopper_mlp-{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        subprocess.run([nvcc, "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-shared",
                        "-Xcompiler", "-fPIC", "-o", scratch, str(SOURCE)], capture_output=True, text=True,
                       check=True)
        os.replace(scratch, target)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    return target


def _load() -> ctypes.CDLL | None:
    global _library, _load_failed
    if _library is not None or _load_failed:
        return _library
    nvcc = _nvcc()
    try:
        if nvcc is None:
            raise FileNotFoundError("nvcc not found")
        library = ctypes.CDLL(str(_build(nvcc)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr[-2000:] if isinstance(e, subprocess.CalledProcessError) else str(e)
        logger.warning("the fused gate_up + SiLU-and-mul kernel is off (cuBLAS + SiLU-and-mul instead): %s", detail)
        _load_failed = True
        return None
    library.tandem_gate_up_silu.restype = ctypes.c_int
    library.tandem_gate_up_silu.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                            ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    _library = library
    return library


def _operands(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """bf16 on one GPU, 2-D, contiguous, 16-byte aligned (what a TMA tensor map reads), K equal and a multiple of 64."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.dim() == 2
            and weight.dim() == 2 and x.device == weight.device and x.shape[1] == weight.shape[1]
            and x.shape[1] % BLOCK_K == 0 and x.is_contiguous() and weight.is_contiguous()
            and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0)


def shape_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes these operands: bf16 on a GPU, contiguous, 16-byte aligned, K a multiple of 64,
    I a multiple of 112, and a row count it was measured to win at. Not whether the GPU is a Hopper one or the
    kernel builds (`device_supported`, asked once per engine): this is the per-step check."""
    return (_operands(x, weight) and MIN_ROWS <= x.shape[0] <= MAX_ROWS
            and weight.shape[0] % (2 * HALF_TILE) == 0)


def device_supported(device: torch.device) -> bool:
    """A Hopper GPU (sm_90) and a kernel that builds and loads (nvcc runs here at the first call)."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
            and _load() is not None)


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [M, K]; weight: [2I, K] (gate rows then up rows) -> silu(x @ gate^T) * (x @ up^T): [M, I]. Callers
    check `device_supported` once and `shape_supported` per call; operands it does not take are a ValueError here,
    never a launch on pointers the kernel cannot read."""
    library = _load() if device_supported(x.device) else None
    if library is None or not shape_supported(x, weight):
        raise ValueError(f"gate_up_silu does not take x {tuple(x.shape)} {x.dtype} on {x.device}, "
                         f"weight {tuple(weight.shape)}")
    rows, k = x.shape
    out = torch.empty(rows, weight.shape[0] // 2, dtype=x.dtype, device=x.device)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    err = library.tandem_gate_up_silu(x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, weight.shape[0], k,
                                      x.device.index, stream)
    if err:
        raise RuntimeError(f"gate_up_silu kernel failed with code {err}")
    return out
