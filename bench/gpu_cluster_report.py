"""The Markdown summary of bench/gpu_cluster.py's results.json."""

from __future__ import annotations

from typing import Any

_MODES = {"pd": "P/D", "colocated": "colocated"}


def _number(value: Any, digits: int = 1) -> str:
    return f"{value:,.{digits}f}" if isinstance(value, (int, float)) else ""


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def serving_table(serving: list[dict[str, Any]], hf: list[dict[str, Any]]) -> list[str]:
    rows = []
    for r in sorted(serving, key=lambda r: (r["input_len"], r["concurrency"], r["mode"] != "pd")):
        status = r.get("skipped") or r.get("error") or ""
        rows.append([f"{r['input_len']} / {r['output_len']}", str(r["concurrency"]), str(r["num_prompts"]),
                     _MODES.get(r["mode"], r["mode"]), _number(r.get("request_throughput"), 2),
                     _number(r.get("output_throughput"), 0), _number(r.get("median_ttft_ms"), 0),
                     _number(r.get("p99_ttft_ms"), 0), _number(r.get("median_tpot_ms"), 1),
                     _number(r.get("p99_tpot_ms"), 1), _number(r.get("request_goodput"), 2),
                     str(r.get("failed", "")), status])
    for r in hf:
        rows.append([f"{r['input_len']} / {r['output_len']}", f"batch {r['batch_size']}", str(r["batch_size"]),
                     "transformers generate", "", _number(r["output_throughput"], 0), "", "", "", "", "", "", ""])
    return _table(["in / out", "concurrency", "prompts", "mode", "req/s", "out tok/s", "TTFT p50 ms",
                   "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "goodput req/s", "failed", "note"], rows)


def latency_table(latency: list[dict[str, Any]]) -> list[str]:
    rows = [[str(r["prompt_len"]), r["mode"], _number(r["ttft_ms"]), _number(r["first_to_second_ms"])]
            for r in sorted(latency, key=lambda r: (r["prompt_len"], r["mode"]))]
    lines = _table(["prompt tokens", "mode", "TTFT ms (median)", "first -> second token ms (median)"], rows)
    by_key = {(r["prompt_len"], r["mode"]): r for r in latency}
    for prompt_len in sorted({r["prompt_len"] for r in latency}):
        pd, alone = by_key.get((prompt_len, "P/D")), by_key.get((prompt_len, "colocated"))
        if pd and alone:
            lines.append(f"\nHandoff at {prompt_len} tokens adds "
                         f"{pd['first_to_second_ms'] - alone['first_to_second_ms']:.1f} ms to the second token.")
    return lines


def markdown_report(data: dict[str, Any]) -> str:
    plan = data["plan"]
    device = data.get("device_info", {}).get("gpu") or plan["device"]
    num_gpus = plan.get("num_gpus", 1)
    layout = "one GPU" if num_gpus == 1 else (f"{num_gpus} GPUs (P/D: P on GPU 0, D on GPU 1; colocated: a decode "
                                              f"node on each GPU)")
    lines = [f"## Tandem on {layout}: {plan['model'].rsplit('/', 1)[-1]} ({plan['dtype']}, {device}), "
             f"KV backend {plan['kv_backend']}", ""]
    if plan.get("goodput"):
        lines += [f"Goodput SLOs: {' '.join(plan['goodput'])}", ""]
    correctness = data.get("correctness", {})
    verdict = "OK" if correctness.get("ok") else "FAIL"
    lines += [f"Correctness (P/D vs colocated, greedy {plan['correctness_tokens']} tokens): **{verdict}**", ""]
    lines += [f"    {line}" for line in correctness.get("report", [])]
    if data.get("latency"):
        lines += ["", *latency_table(data["latency"])]
    for mode, stats in data.get("kv_transfer", {}).items():
        if stats.get("transfers"):
            lines += ["", f"KV pulls ({_MODES.get(mode, mode)}): {stats['transfers']} transfers, "
                          f"{stats['bytes'] / 1e9:.2f} GB in {stats['seconds']:.2f} s = {stats['gb_per_s']:.1f} GB/s, "
                          f"{stats['failures']} failures"]
    if data.get("serving") or data.get("hf_generate"):
        lines += ["", *serving_table(data.get("serving", []), data.get("hf_generate", []))]
    if data.get("errors"):
        lines += ["", "Errors:", *(f"- {e.splitlines()[0]}" for e in data["errors"])]
    lines += ["", f"({data.get('elapsed_s', 0):.0f} s)"]
    return "\n".join(lines)
