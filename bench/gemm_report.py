"""The start-up GEMM tuning's timings (engine/kernels/lt_gemm.py) as a table, for the GPU benchmarks' output."""

from __future__ import annotations

from typing import Any


def gemm_tuning_lines(runner: Any) -> list[str]:
    timings = getattr(runner, "gemm_timings", [])
    if not timings:
        return ["GEMM tuning: off (or nothing to tune)"]
    lines = ["| GEMM M x N x K | F.linear us | TFLOP/s | best cuBLASLt us | TFLOP/s | candidates | used |",
             "|---|---|---|---|---|---|---|"]
    for t in timings:
        flop = 2 * t.m * t.n * t.k
        lines.append(f"| {t.m} x {t.n} x {t.k} | {t.linear_seconds * 1e6:.1f} | {flop / t.linear_seconds / 1e12:.0f} "
                     f"| {t.lt_seconds * 1e6:.1f} | {flop / t.lt_seconds / 1e12:.0f} | {t.candidates} "
                     f"| {'yes' if t.replaced else 'no'} |")
    return lines
