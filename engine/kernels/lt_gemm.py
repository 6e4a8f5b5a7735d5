"""GEMMs through cuBLASLt with the algorithm picked by timing, for the row counts the engine runs most.

torch's F.linear takes cuBLAS's first choice. At the decode graphs' row counts that is often not the fastest
of the configurations cuBLASLt itself offers (H100, M = 256: the best of its list 2.5-8% faster on o_proj,
gate_up and down, bench/results/engine-speed-2026-12-05-late.md), and torch exposes no way to choose. So this
module calls cuBLASLt, the library torch itself links, through ctypes: at start-up, for every decode graph's
batch size and the full prompt step's token count, each linear shape's candidates (the heuristic's list and
F.linear) are timed on the model's own weights, in CUDA graphs as the decode steps run, and a layer keeps a
cuBLASLt algorithm only where it beat F.linear by a margin. Any other call (another row count, a bias, an
unaligned or strided input) falls back to F.linear.

Which algorithm wins can differ between two starts when two are within the timing's noise; each sums in fp32
and rounds once to the output dtype, so the outputs differ by at most that rounding.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import ColumnParallelLinear, RowParallelLinear

logger = logging.getLogger(__name__)
TunableLinear = ColumnParallelLinear | RowParallelLinear

# cublasLt.h / cublas_api.h / library_types.h (CUDA 12 and 13 alike)
_COMPUTE_32F = 68
_R_32F, _R_16F, _R_16BF = 0, 2, 14
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_OP_N, _OP_T = 0, 1
_PREF_MAX_WORKSPACE_BYTES = 1
_STATUS_SUCCESS = 0
_DTYPES = {torch.bfloat16: _R_16BF, torch.float16: _R_16F}

WORKSPACE_BYTES = 32 << 20
ALIGNMENT = 256  # the heuristic's default minimum pointer alignment: its algorithms may rely on it
CANDIDATES = 8  # of the heuristic's list
MARGIN = 0.02  # a cuBLASLt algorithm replaces F.linear only if at least this much faster


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _library() -> ctypes.CDLL:
    """The libcublasLt torch loaded (its path from the process's own mappings), else the one the loader finds;
    with the argument types of the calls made here (a size_t passed as a bare int would leave its upper half
    undefined)."""
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if "libcublasLt.so" in line})
    for name in [*paths, "libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        raise OSError("libcublasLt not found")
    ptr, out, i32, u64, size = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64, \
        ctypes.c_size_t
    lib.cublasLtCreate.argtypes = [out]
    lib.cublasLtMatmulDescCreate.argtypes = [out, i32, i32]
    lib.cublasLtMatmulDescSetAttribute.argtypes = [ptr, i32, ptr, size]
    lib.cublasLtMatrixLayoutCreate.argtypes = [out, i32, u64, u64, ctypes.c_int64]
    lib.cublasLtMatmulPreferenceCreate.argtypes = [out]
    lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [ptr, i32, ptr, size]
    lib.cublasLtMatmulPreferenceDestroy.argtypes = [ptr]
    lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, i32,
                                                   ctypes.POINTER(_HeuristicResult), ctypes.POINTER(i32)]
    lib.cublasLtMatmul.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr,
                                   ctypes.POINTER(_Algo), ptr, size, ptr]
    return lib


def _check(status: int, what: str) -> None:
    if status != _STATUS_SUCCESS:
        raise RuntimeError(f"cuBLASLt {what} failed with status {status}")


class LtContext:
    """One device's cuBLASLt handle and workspace (both live as long as a graph that captured a call)."""

    def __init__(self, device: torch.device) -> None:
        self.lib = _library()
        self.device = device
        self.handle = ctypes.c_void_p()
        with torch.cuda.device(device):
            _check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "create")
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.alpha_ptr, self.beta_ptr = ctypes.addressof(self.alpha), ctypes.addressof(self.beta)


class LtShape:
    """out[M, N] = x[M, K] @ W[N, K]^T for one (M, N, K, dtype), as cuBLASLt's column-major out^T = W x^T:
    A = W (K x N, transposed), B = x (K x M), D = out^T (N x M)."""

    def __init__(self, ctx: LtContext, m: int, n: int, k: int, dtype: torch.dtype) -> None:
        self.ctx, self.m, self.n, self.k, self.dtype = ctx, m, n, k, dtype
        lib, kind = ctx.lib, _DTYPES[dtype]
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F), "desc")
        for attr, op in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)):
            value = ctypes.c_int32(op)
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.addressof(value),
                                                      4), "desc attribute")
        self.a, self.b, self.d = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        for layout, rows, cols in ((self.a, k, n), (self.b, k, m), (self.d, n, m)):
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), kind, rows, cols, rows), "layout")

    def candidates(self, count: int = CANDIDATES) -> list[_Algo]:
        lib = self.ctx.lib
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        try:
            size = ctypes.c_uint64(WORKSPACE_BYTES)
            _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES,
                                                            ctypes.addressof(size), 8),
                   "preference attribute")
            results = (_HeuristicResult * count)()
            returned = ctypes.c_int(0)
            _check(lib.cublasLtMatmulAlgoGetHeuristic(self.ctx.handle, self.desc, self.a, self.b, self.d, self.d,
                                                      pref, count, results, ctypes.byref(returned)), "heuristic")
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        return [r.algo for r in results[:returned.value]
                if r.state == _STATUS_SUCCESS and r.workspace_size <= WORKSPACE_BYTES]

    def run(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, algo: _Algo) -> None:
        ctx = self.ctx
        status = ctx.lib.cublasLtMatmul(
            ctx.handle, self.desc, ctx.alpha_ptr, weight.data_ptr(), self.a, x.data_ptr(), self.b, ctx.beta_ptr,
            out.data_ptr(), self.d, out.data_ptr(), self.d, ctypes.byref(algo), ctx.workspace.data_ptr(),
            WORKSPACE_BYTES, torch.cuda.current_stream(x.device).cuda_stream)
        _check(status, "matmul")


@dataclass(frozen=True)
class Timing:
    """One shape at one row count: F.linear's time and the best cuBLASLt candidate's, a call each."""

    m: int
    n: int
    k: int
    linear_seconds: float
    lt_seconds: float
    candidates: int
    replaced: bool


@dataclass
class _Choice:
    shape: LtShape
    algo: _Algo


class TunedGemm:
    """A layer's chosen cuBLASLt algorithms by row count (shared by the layers of one weight shape); called by
    the linear layers' forward: the output, or None where F.linear should run."""

    def __init__(self) -> None:
        self.by_rows: dict[int, _Choice] = {}

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        choice = self.by_rows.get(x.shape[0]) if x.dim() == 2 else None
        if choice is None or x.dtype != choice.shape.dtype or weight.dtype != x.dtype:
            return None
        shape = choice.shape
        if not (x.shape[1] == shape.k and tuple(weight.shape) == (shape.n, shape.k) and x.is_contiguous()
                and weight.is_contiguous() and x.data_ptr() % ALIGNMENT == 0 and weight.data_ptr() % ALIGNMENT == 0):
            return None
        out = torch.empty(x.shape[0], shape.n, dtype=x.dtype, device=x.device)
        shape.run(x, weight, out, choice.algo)
        return out


def _graph_seconds(run: Callable[[], None], replays: int = 3) -> float:
    """Best replay time of a CUDA graph of `run` (as a decode step replays it: no host time in the number).
    Captured without torch.cuda.graph's context, whose garbage collection at each capture would cost more than
    the hundreds of timings together."""
    run()  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            run()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    best = float("inf")
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del graph
    return best


def pick(linear_seconds: float, lt_seconds: list[float], margin: float = MARGIN) -> int | None:
    """Index of the fastest cuBLASLt candidate if it beats F.linear by `margin`, else None (F.linear stays)."""
    if not lt_seconds:
        return None
    best = min(range(len(lt_seconds)), key=lt_seconds.__getitem__)
    return best if lt_seconds[best] < linear_seconds * (1 - margin) else None


def tunable_linears(model: nn.Module) -> dict[tuple[int, int, torch.dtype], list[TunableLinear]]:
    """The model's bias-free 16-bit linear layers whose forward consults `tuned_gemm`, by weight shape."""
    groups: dict[tuple[int, int, torch.dtype], list[TunableLinear]] = defaultdict(list)
    for module in model.modules():
        if (isinstance(module, ColumnParallelLinear | RowParallelLinear) and module.bias is None
                and module.weight.dtype in _DTYPES and module.weight.is_cuda):
            groups[(*module.weight.shape, module.weight.dtype)].append(module)
    return groups


def _tune_shape(shape: LtShape, rotation: list[torch.Tensor], margin: float) -> tuple[Timing, _Choice | None]:
    m, n, k, dtype = shape.m, shape.n, shape.k, shape.dtype
    algos = shape.candidates()
    x = torch.randn(m, k, dtype=dtype, device=rotation[0].device)
    out = torch.empty(m, n, dtype=dtype, device=x.device)

    def with_linear() -> None:
        for w in rotation:
            torch.mm(x, w.t(), out=out)

    def with_algo(algo: _Algo) -> Callable[[], None]:
        def run() -> None:
            for w in rotation:
                shape.run(x, w, out, algo)
        return run

    linear_seconds = _graph_seconds(with_linear)
    lt_seconds = []
    for algo in algos:
        try:
            lt_seconds.append(_graph_seconds(with_algo(algo)))
        except RuntimeError:  # an algorithm the heuristic offered but that would not launch
            lt_seconds.append(float("inf"))
    linear_seconds = min(linear_seconds, _graph_seconds(with_linear))  # the baseline timed twice
    best = pick(linear_seconds, lt_seconds, margin)
    choice = None
    if best is not None:
        shape.run(x, rotation[0], out, algos[best])
        if torch.allclose(out.float(), F.linear(x, rotation[0]).float(), rtol=2e-2, atol=2e-2):
            choice = _Choice(shape, algos[best])
        else:
            logger.warning("cuBLASLt algorithm for %d x %d x %d gave another result: not used", m, n, k)
    calls = len(rotation)
    return Timing(m, n, k, linear_seconds / calls, min(lt_seconds, default=float("inf")) / calls, len(algos),
                  choice is not None), choice


@torch.no_grad()  # the weights may be parameters that require grad; nothing here is differentiated
def tune_linears(model: nn.Module, rows: Iterable[int], logits_rows: Iterable[int] = (),
                 l2_bytes: int | None = None, margin: float = MARGIN) -> list[Timing]:
    """Times every tunable linear shape at each row count and attaches the winners (engine/layers/linear.py).

    rows: the row counts of the decode graphs and the full prompt step; logits_rows: those at which the lm_head
    runs too (the decode graphs'; a prompt step samples a few rows). Each candidate runs over the group's weights
    in turn, enough of them to outgrow the L2 cache, as a step finds them. Returns what was timed."""
    groups = tunable_linears(model)
    timings: list[Timing] = []
    if not groups:
        return timings
    device = next(iter(groups.values()))[0].weight.device
    ctx = LtContext(device)
    l2_bytes = l2_bytes or torch.cuda.get_device_properties(device).L2_cache_size
    lm_head = getattr(model, "lm_head", None)
    rows, logits_rows = sorted(set(rows)), set(logits_rows)
    started = time.perf_counter()
    for (n, k, dtype), layers in groups.items():
        tuned = TunedGemm()
        weight_bytes = n * k * torch.finfo(dtype).bits // 8
        rotation = [layer.weight for layer in layers[:max(2, -(-3 * l2_bytes // weight_bytes))]]
        rotation = rotation * max(1, -(-8 // len(rotation)))  # >= 8 calls a timing: above the events' noise
        for m in rows:
            if lm_head is not None and lm_head in layers and m not in logits_rows:
                continue
            timing, choice = _tune_shape(LtShape(ctx, m, n, k, dtype), rotation, margin)
            timings.append(timing)
            if choice is not None:
                tuned.by_rows[m] = choice
        if tuned.by_rows:
            for layer in layers:
                layer.tuned_gemm = tuned
    torch.cuda.synchronize(device)
    logger.info("GEMM tuning: %d of %d shapes x row counts on cuBLASLt algorithms, %.1f s",
                sum(t.replaced for t in timings), len(timings), time.perf_counter() - started)
    return timings
