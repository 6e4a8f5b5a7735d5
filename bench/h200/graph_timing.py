"""The GEMM probes' timer: a CUDA graph of `reps` calls, so that no host time is in the number (as in the engine's
decode graphs). Callers pass enough weight copies to exceed L2, so that every call reads its weight from HBM."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_time_ms(fn: Callable[[torch.Tensor], object], weights: list[torch.Tensor], reps: int) -> float:
    """Milliseconds a call of fn(weight), averaged over one replay of `reps` calls (after a warm-up replay)."""
    for w in weights[:3]:
        fn(w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(weights[i % len(weights)])
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps
