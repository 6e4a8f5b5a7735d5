"""The CPU path's C++ kernels, built at first use into one extension, and the layer ops' Python side.

The sources: `cpu_paged_attention.cpp` (decode attention that reads K/V in place, engine/layers/cpu_paged_attention.py),
`cpu_layer_ops.cpp` (RMSNorm with the residual add, RoPE with the K/V store, SiLU-and-mul), `cpu_linear.cpp` (bf16
linear layers on AVX512-BF16, engine/layers/cpu_linear.py) and `cpu_prefill_attention.cpp` (a prefill's attention
over the paged cache on AVX512-BF16, engine/layers/attention.py: prefill_attention). Why the layer ops:
in torch each is 4-12 small ops, ~45 us a call at batch 8 whatever the size, so a decode step of a 30-layer model
spent ~9 ms of ~34 in them (bench/results/engine-speed-2026-12-04-evening.md); one pass over the rows costs a few us.
Each op rounds where torch's eager ops round, so a 16-bit model's numbers stay those of transformers' eager math,
but for RMSNorm's sum of squares and SiLU's exp, computed in another order than torch's: a value on a rounding
boundary can come out one rounding apart. So float32, the parity dtype, fuses only RoPE + store, which are exact.

The extension is compiled with torch's C++ extension builder (a C++ compiler and ninja, as on the bench and CI
boxes) into torch's extension cache (~40 s, once per machine, source and torch version; `make setup` does it).
Where it cannot be built, the torch paths serve, and the reason is logged once.
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

_DIR = Path(__file__).parent
_SOURCES = [_DIR / name for name in ("cpu_paged_attention.cpp", "cpu_layer_ops.cpp", "cpu_linear.cpp",
                                      "cpu_prefill_attention.cpp")]
_HEADERS = [_DIR / "cpu_vec.h"]
_FUNCTIONS = ["paged_decode_attention", "rms_norm", "rotary_and_store_kv", "silu_and_mul", "bf16_kernels_usable",
              "pack_bf16_linear_weight", "bf16_linear", "paged_prefill_attention"]
HALF_DTYPES = (torch.bfloat16, torch.float16)

# a build's lock older than this was left by a process killed while building (torch would wait on it forever)
_STALE_LOCK_S = 600.0


@functools.cache
def kernel() -> ModuleType | None:
    """The compiled extension, or None where it cannot be built here."""
    try:
        from torch.utils.cpp_extension import _get_build_directory, _import_module_from_library, load_inline

        # -fopenmp: at::parallel_for splits the work only where OpenMP is on; the libgomp.so.1 it links is
        # torch's, already loaded by that name, so the kernels run on the engine thread's own OpenMP team.
        # -ffp-contract=off: a * b - c * d stays two rounded products and a difference, as in torch's eager ops
        # (the layer ops round as torch does; the attention kernel asks for its multiply-adds explicitly).
        flags = ["-O3", "-fopenmp", "-ffp-contract=off"]
        if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
            flags += ["-mavx2", "-mfma", "-mf16c"]  # eight floats at a time (engine/layers/cpu_vec.h)
        sources = [source.read_text() for source in _SOURCES]
        # the name carries what the build depends on, so a build found under it is this one: loaded without
        # torch's build lock and ninja (a node killed while holding that lock would stall every later start)
        headers = [header.read_text() for header in _HEADERS]
        digest = hashlib.sha256("\0".join([*sources, *headers, *flags, torch.__version__]).encode()).hexdigest()[:16]
        name = f"tandem_cpu_kernels_{digest}"
        build_dir = Path(_get_build_directory(name, verbose=False))
        if (build_dir / f"{name}.so").is_file():
            return _import_module_from_library(name, str(build_dir), True)
        lock = build_dir / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            lock.unlink(missing_ok=True)
        return load_inline(name=name, cpp_sources=sources, functions=_FUNCTIONS, extra_cflags=flags,
                           extra_ldflags=["-fopenmp"], extra_include_paths=[str(_DIR)],
                           build_directory=str(build_dir))
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: the torch paths serve
        logger.warning("the CPU kernels could not be built (%s); attention and the layers' small ops use torch",
                       str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None


@functools.cache
def has_bf16_dot() -> bool:
    """Whether the AVX512-BF16 kernels (bf16 linears, the bf16 decode walk, prefill attention) run here: the CPU has
    the instructions and the kernels built. The C++ side asks the CPU once (cpu_vec.h: has_bf16_dot)."""
    module = kernel()
    return module is not None and bool(module.bf16_kernels_usable())


def layer_ops_serve(x: torch.Tensor, float32: bool) -> bool:
    """Whether a fused layer op computes for these activations: on the CPU, in bf16 or fp16, or also in float32
    where the op is bit-equal to torch's there too (RoPE and the store are; RMSNorm's sum and SiLU's exp are not
    summed and rounded as torch's vectorized kernels do, so float32 keeps torch's ops: it is the parity dtype)."""
    return (x.device.type == "cpu" and (x.dtype in HALF_DTYPES or (float32 and x.dtype == torch.float32))
            and kernel() is not None)


def _module() -> ModuleType:
    module = kernel()
    assert module is not None, "layer_ops_serve() says whether the kernels are there"
    return module


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * RMSNorm(s), s) with s = x + residual, or x without a residual; x: [..., H]."""
    if x.dim() == 2 and x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1):
        # the decoder's hidden states: as they are (each reshape here is ~1 us of a ~5 us op)
        out, summed = _module().rms_norm(x, residual, weight.to(x.dtype), eps)
        return out, (x if residual is None else summed)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    res = None if residual is None else residual.reshape(rows.shape).contiguous()
    out, summed = _module().rms_norm(rows, res, weight.to(x.dtype), eps)
    return out.view(x.shape), (x if residual is None else summed.view(x.shape))


def rotary_and_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        cos_sin: torch.Tensor, k_cache: torch.Tensor | None = None,
                        v_cache: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, Hq, D] and k [T, Hkv, D] in place and, given the caches, stores k and v at their slots."""
    _module().rotary_and_store_kv(positions.long(), q, k, v, cos_sin, k_cache, v_cache,
                                  None if slot_mapping is None else slot_mapping.long())
    return q, k


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up) -> [T, I]."""
    return _module().silu_and_mul(gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous())
