"""Validate the cluster simulator (benchmark/sim/) against the running system: for each cluster shape, start
`tandem serve` as a user does, run `tandem bench serve` for each workload, then simulate the same requests from
the node profile, and tabulate predicted vs measured TTFT/TPOT p50 and p90 and output throughput.

The simulator gets what the client sent, not a fresh draw: each request's prompt and output lengths and, for
rate-driven workloads, its measured send time (the client's `start_times`); fixed-concurrency workloads replay
the same requests under the same concurrency limit. So the table checks the service model, not the luck of two
random arrival draws.

    .venv/bin/python bench/sim_validate.py --profile bench/results/profile-cpu-smollm2-1thread.json \\
        --out bench/results/planner-2026-12-07.md

Writes the Markdown table (appended to --out) and the raw bench/sim numbers (JSON, next to it).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serve_process import REPO, TANDEM, start_serve, stop_serve  # noqa: E402
from benchmark.profile import Profile, load_profile  # noqa: E402
from benchmark.sim import SimRequest, simulate  # noqa: E402
from cluster.models import resolve_model  # noqa: E402

TOLERANCE = 0.20


@dataclass(frozen=True)
class Shape:
    prefill: int
    decode: int
    colocate_max_tokens: int

    @property
    def name(self) -> str:
        if self.prefill == 0:
            return f"colocated x{self.decode}"
        return f"{self.prefill}P{self.decode}D"


@dataclass(frozen=True)
class Workload:
    name: str
    input_len: int
    output_len: int
    num_prompts: int
    rate: float | None  # requests/s (Poisson); None: closed loop at `concurrency`
    concurrency: int | None
    seed: int  # each workload its own: the same seed draws the same leading tokens, a prefix-cache hit

    def bench_args(self) -> list[str]:
        args = ["--dataset-name", "random", "--random-input-len", str(self.input_len), "--random-output-len",
                str(self.output_len), "--num-prompts", str(self.num_prompts), "--ignore-eos", "--seed", str(self.seed),
                "--metric-percentiles", "50,90", "--save-result", "--save-detailed", "--disable-tqdm"]
        if self.rate is not None:
            args += ["--request-rate", str(self.rate)]
        if self.concurrency is not None:
            args += ["--max-concurrency", str(self.concurrency)]
        return args


SHAPES = {"colocated": Shape(0, 1, 0), "1p1d": Shape(1, 1, 0), "1p2d": Shape(1, 2, 0), "2p1d": Shape(2, 1, 0)}
WORKLOADS = {
    "chat": Workload("chat 256/64, concurrency 4", 256, 64, 24, None, 4, seed=7),
    "long": Workload("long 512/16, 0.2 req/s", 512, 16, 16, 0.2, None, seed=8),
}


def serve(shape: Shape, port: int, log: Path) -> subprocess.Popen[bytes]:
    return start_serve(["--prefill-nodes", str(shape.prefill), "--decode-nodes", str(shape.decode),
                        "--node-threads", "1", "--port", str(port),
                        "--proxy-args", f"--colocate-max-tokens {shape.colocate_max_tokens}"], log)


def bench(port: int, workload: Workload, out_dir: Path, label: str) -> dict[str, Any]:
    name = f"{label}.json"
    tokenizer = resolve_model(None, None)[0]  # the model `tandem serve` serves by default
    argv = [*TANDEM, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--tokenizer", str(tokenizer),
            "--result-dir", str(out_dir),
            "--result-filename", name, "--label", label, *workload.bench_args()]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"tandem bench serve {label} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads((out_dir / name).read_text())
    return result


def simulated(profile: Profile, shape: Shape, workload: Workload, measured: dict[str, Any]) -> dict[str, float]:
    starts = measured["start_times"]
    first = min(starts)
    requests = [SimRequest(arrival_s=(s - first) if workload.rate is not None else 0.0, prompt_tokens=i,
                           output_tokens=o)
                for s, i, o in zip(starts, measured["input_lens"], measured["output_lens"], strict=True)]
    result = simulate(profile=profile, requests=requests, prefill_nodes=shape.prefill, decode_nodes=shape.decode,
                      colocate_max_tokens=shape.colocate_max_tokens, max_concurrency=workload.concurrency,
                      percentiles=(50.0, 90.0))
    m = result.metrics
    out = {"output_throughput": m.output_throughput}
    for metric in ("ttft", "tpot"):
        for p, value in m.distributions[metric].percentiles:
            out[f"p{p:g}_{metric}_ms"] = value
    return out


def measured_numbers(result: dict[str, Any]) -> dict[str, float]:
    if result.get("total_cached_tokens"):
        raise RuntimeError(f"{result['label']}: {result['total_cached_tokens']} prompt tokens hit the prefix cache: "
                           "the simulator computes every prompt token")
    out = {"output_throughput": float(result["output_throughput"])}
    for metric in ("ttft", "tpot"):
        for p in (50, 90):
            out[f"p{p}_{metric}_ms"] = float(result[f"p{p}_{metric}_ms"])
    return out


COLUMNS = ("p50_ttft_ms", "p90_ttft_ms", "p50_tpot_ms", "p90_tpot_ms", "output_throughput")


def table(rows: list[tuple[str, str, dict[str, float], dict[str, float]]]) -> str:
    head = "| shape | workload | " + " | ".join(f"{c} meas / sim (err)" for c in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 2)]
    within = total = 0
    for shape, workload, meas, sim in rows:
        cells = []
        for c in COLUMNS:
            err = (sim[c] - meas[c]) / meas[c] if meas[c] else float("nan")
            total += 1
            within += abs(err) <= TOLERANCE
            cells.append(f"{meas[c]:.1f} / {sim[c]:.1f} ({err:+.0%})")
        lines.append(f"| {shape} | {workload} | " + " | ".join(cells) + " |")
    lines.append(f"\n{within} of {total} predictions within {TOLERANCE:.0%} of measured.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--shapes", default="colocated,1p1d,2p1d", help=f"of {','.join(SHAPES)}")
    parser.add_argument("--workloads", default="chat,long", help=f"of {','.join(WORKLOADS)}")
    parser.add_argument("--out", type=Path, required=True, help="Markdown file the table is appended to")
    parser.add_argument("--port", type=int, default=8311)
    parser.add_argument("--resimulate", type=Path, default=None,
                        help="a directory of an earlier run: simulate its bench results again, measure nothing")
    args = parser.parse_args()
    profile = load_profile(args.profile)
    raw_dir = args.resimulate or Path(tempfile.mkdtemp(prefix="sim-validate-"))
    rows, raw = [], []
    for shape_key in args.shapes.split(","):
        shape = SHAPES[shape_key]
        proc = None if args.resimulate else serve(shape, args.port, raw_dir / f"serve-{shape_key}.log")
        try:
            for key in args.workloads.split(","):
                workload = WORKLOADS[key]
                label = f"{shape_key}-{key}"
                result = (json.loads((raw_dir / f"{label}.json").read_text()) if proc is None
                          else bench(args.port, workload, raw_dir, label))
                meas, sim = measured_numbers(result), simulated(profile, shape, workload, result)
                rows.append((shape.name, workload.name, meas, sim))
                raw.append({"shape": shape_key, "workload": key, "measured": meas, "simulated": sim,
                            "failed": result.get("failed", 0)})
                print(f"{shape.name} / {workload.name}: measured {meas}\n  simulated {sim}", flush=True)
        finally:
            if proc is not None:
                stop_serve(proc)
    text = table(rows)
    print(text)
    with args.out.open("a") as f:
        f.write(f"\n```bash\n.venv/bin/python {' '.join(sys.argv)}\n```\n\nraw results: {raw_dir}\n\n{text}\n")
    args.out.with_suffix(".validation.json").write_text(json.dumps(raw, indent=1) + "\n")


if __name__ == "__main__":
    main()
