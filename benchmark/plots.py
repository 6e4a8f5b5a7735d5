"""PNG plots of result files (matplotlib, an optional dependency: `pip install 'tandem[bench]'`).

- `<name>-distributions.png`: the CDFs of TTFT and TPOT of each run (needs the per-request lists of a run
  saved with --save-detailed, or handed over in memory by `bench serve --plot`).
- `sweep.png`: output throughput against median and p99 TTFT and TPOT, one line per label (a sweep's runs share
  a label, so several systems' sweeps land on one plot).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

Named = tuple[str, dict[str, Any]]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plots need matplotlib: pip install matplotlib (or tandem[bench])") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def request_tpots_ms(result: dict[str, Any]) -> list[float]:
    """Per-request TPOT (ms) from a detailed result's ttfts, latencies and output_lens (requests of > 1 token)."""
    rows = zip(result["ttfts"], result["latencies"], result["output_lens"], strict=True)
    return [(latency - ttft) / (n - 1) * 1000 for ttft, latency, n in rows if n > 1]


def plot_distributions(results: Sequence[Named], out_path: Path) -> Path | None:
    """TTFT and TPOT CDFs, one line per result; None if no result has per-request data."""
    detailed = [(name, r) for name, r in results if "ttfts" in r and "latencies" in r and "output_lens" in r]
    if not detailed:
        return None
    plt = _pyplot()
    figure, (ttft_axis, tpot_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for name, result in detailed:
        ok = [not e for e in result.get("errors", [""] * len(result["ttfts"]))]
        ttfts = sorted(t * 1000 for t, good in zip(result["ttfts"], ok, strict=True) if good)
        tpots = sorted(request_tpots_ms(result))
        for axis, values in ((ttft_axis, ttfts), (tpot_axis, tpots)):
            if values:
                axis.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
    for axis, title in ((ttft_axis, "TTFT (ms)"), (tpot_axis, "TPOT (ms)")):
        _label(axis, title, "fraction of requests")
    return _save(plt, figure, out_path)


def plot_sweep(results: Sequence[Named], out_path: Path) -> Path:
    """Throughput against latency: x = output tok/s, y = TTFT and TPOT (median solid, p99 dashed)."""
    plt = _pyplot()
    series: dict[str, list[dict[str, Any]]] = {}
    for name, result in results:
        series.setdefault(result.get("label") or name, []).append(result)
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, runs in series.items():
        runs = sorted(runs, key=lambda r: r["output_throughput"])
        x = [r["output_throughput"] for r in runs]
        for axis, metric in zip(axes, ("ttft", "tpot"), strict=True):
            median = [r.get(f"median_{metric}_ms") for r in runs]
            (line,) = axis.plot(x, median, marker="o", label=f"{label} median")
            if all(f"p99_{metric}_ms" in r for r in runs):
                axis.plot(x, [r[f"p99_{metric}_ms"] for r in runs], marker="x", linestyle="--",
                          color=line.get_color(), label=f"{label} p99")
    for axis, metric in zip(axes, ("TTFT", "TPOT"), strict=True):
        _label(axis, "output throughput (tok/s)", f"{metric} (ms)")
    return _save(plt, figure, out_path)


def _label(axis: Any, xlabel: str, ylabel: str) -> None:
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)


def _save(plt: Any, figure: Any, out_path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(out_path, dpi=110)
    plt.close(figure)
    return out_path
