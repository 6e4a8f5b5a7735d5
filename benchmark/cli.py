"""`tandem bench serve | compare | plot`, with vLLM's `bench serve` flag spellings.

    tandem bench serve --base-url http://127.0.0.1:8000 --model NAME --tokenizer DIR \\
        --dataset-name random --random-input-len 128 --random-output-len 32 --num-prompts 32 \\
        --max-concurrency 4 --request-rate 1,2,inf --save-result --result-dir results/ [--plot]
    tandem bench compare A.json B.json [--markdown]
    tandem bench plot A.json B.json ... --output-dir DIR

`--request-rate` and `--max-concurrency` take comma-separated lists: one run per combination, back to back.

multi-turn-session (chat only): num_prompts / num_turns conversations, all sharing one system prompt
(--multi-turn-system-prompt-len). A conversation is sequential: turn k+1 is sent after turn k's reply has
streamed back and a think time has passed (--multi-turn-think-time, spread by --random-range-ratio), and its
messages are the whole history with the server's actual replies. Conversations run side by side (at most
--multi-turn-max-active-sessions open at once); --max-concurrency bounds the turns in flight across them, and
--request-rate paces turn sends (Poisson gaps between sends; a turn that comes late goes at once). The results
add the median TTFT of each turn number and the prompt tokens the server found cached (its usage's
prompt_tokens_details.cached_tokens), so later turns' reuse of earlier ones shows.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tokenizers import Tokenizer

from benchmark.client import RequestSettings
from benchmark.datasets import (
    DATASET_NAMES,
    SESSION_DATASETS,
    DatasetConfig,
    SampleRequest,
    Session,
    get_samples,
    get_sessions,
    load_tokenizer,
)
from benchmark.metrics import METRIC_NAMES, calculate_metrics, parse_goodput
from benchmark.results import (
    DETAILED_KEYS,
    RunInfo,
    build_result,
    compare_table,
    format_report,
    load_result,
    result_filename,
    save_result,
)
from benchmark.runner import LoadSettings, RunOutput, run_requests
from benchmark.sessions import run_sessions

# synthetic workloads run to their output length unless the model's EOS stops them early (vLLM does the same
# for its random dataset)
_SYNTHETIC = ("random", "long-prompt", "shared-prefix", "prefix_repetition", "multi-turn", "multi-turn-session")
_CHAT_ENDPOINT = "/v1/chat/completions"


class BenchError(Exception):
    """Bad flags or an unusable server: printed without a traceback."""


def add_bench_commands(parser: argparse.ArgumentParser) -> None:
    """The `bench` subcommands, on the parser `tandem bench` got; each sets `args.bench_main`."""
    commands = parser.add_subparsers(dest="bench_command", required=True)
    serve = commands.add_parser("serve", help="load a server over the OpenAI API and measure it",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_serve_arguments(serve)
    serve.set_defaults(bench_main=serve_main)
    compare = commands.add_parser("compare", help="result files side by side")
    compare.add_argument("result_files", nargs="+", type=Path)
    compare.add_argument("--markdown", action="store_true", help="a Markdown table")
    compare.set_defaults(bench_main=compare_main)
    plot = commands.add_parser("plot", help="PNG plots of result files (matplotlib)")
    plot.add_argument("result_files", nargs="+", type=Path)
    plot.add_argument("--output-dir", type=Path, default=Path("."))
    plot.set_defaults(bench_main=plot_main)


def _add_serve_arguments(p: argparse.ArgumentParser) -> None:
    server = p.add_argument_group("server")
    server.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (else --host/--port)")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--endpoint", default=None,
                        help="/v1/completions (default) or /v1/chat/completions (default for openai-chat and "
                             "multi-turn-session)")
    server.add_argument("--backend", default="openai", choices=("openai", "openai-chat", "vllm"),
                        help="recorded in the result; openai-chat defaults --endpoint to chat")
    server.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    server.add_argument("--served-model-name", default=None, help="name to send instead of --model")
    server.add_argument("--tokenizer", default=None, help="model directory or tokenizer.json (default: --model)")
    server.add_argument("--api-key", default=None, help="sent as a bearer token")
    server.add_argument("--request-timeout", type=float, default=6 * 3600, help="seconds per request")
    data = p.add_argument_group("workload")
    data.add_argument("--dataset-name", default="random", choices=(*DATASET_NAMES, "custom", "prefix_repetition"),
                      help="multi-turn: every turn's history built up front with synthetic replies, requests sent "
                           "independently; multi-turn-session: conversations sent turn by turn with the server's "
                           "actual replies (see above)")
    data.add_argument("--dataset-path", type=Path, default=None, help="the jsonl dataset's file")
    data.add_argument("--num-prompts", type=int, default=1000)
    data.add_argument("--random-input-len", "--input-len", dest="input_len", type=int, default=None,
                      help="prompt tokens (per user turn for multi-turn, per suffix for shared-prefix; default "
                           "1024, 4096 for long-prompt, 128 for shared-prefix and multi-turn)")
    data.add_argument("--random-output-len", "--output-len", dest="output_len", type=int, default=None,
                      help="max_tokens (default 128)")
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths uniform in [len*(1-r), len*(1+r)] (0: fixed)")
    data.add_argument("--prefix-repetition-prefix-len", "--shared-prefix-len", dest="prefix_len", type=int,
                      default=256)
    data.add_argument("--prefix-repetition-num-prefixes", "--shared-prefix-num-prefixes", dest="num_prefixes",
                      type=int, default=4)
    data.add_argument("--multi-turn-num-turns", dest="num_turns", type=int, default=4,
                      help="user turns per conversation (num_prompts / num_turns conversations)")
    data.add_argument("--multi-turn-system-prompt-len", dest="system_prompt_len", type=int, default=0,
                      help="multi-turn-session: tokens of the system prompt all sessions share (0: none)")
    data.add_argument("--multi-turn-think-time", dest="think_time_s", type=float, default=0.0, metavar="S",
                      help="multi-turn-session: seconds between a reply and the session's next turn, drawn "
                           "uniformly in [S*(1-r), S*(1+r)] from the seed (r: --random-range-ratio; 0: fixed)")
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--sweep-fresh-prompts", action="store_true",
                      help="in a sweep, new prompts for each run (seed + run index) so no run hits the prefix cache "
                           "of the one before (default, as vLLM: the same prompts every run)")
    load = p.add_argument_group("load")
    load.add_argument("--request-rate", default="inf", help="requests/s, Poisson arrivals; a list sweeps: 1,2,inf")
    load.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson; <1 burstier, >1 more even")
    load.add_argument("--max-concurrency", default=None, help="requests in flight at most; a list sweeps: 1,4,16")
    load.add_argument("--multi-turn-max-active-sessions", dest="max_active_sessions", type=int, default=None,
                      help="multi-turn-session: sessions open at once (default: all); a session keeps its place "
                           "through its think times, so this sets how many histories the server must keep")
    load.add_argument("--num-warmups", type=int, default=0, help="uncounted requests before each run")
    load.add_argument("--ignore-eos", action="store_true", help="(always on for the synthetic datasets)")
    load.add_argument("--temperature", type=float, default=None)
    load.add_argument("--top-p", type=float, default=None)
    load.add_argument("--top-k", type=int, default=None)
    load.add_argument("--disable-tqdm", action="store_true")
    out = p.add_argument_group("results")
    out.add_argument("--percentile-metrics", default=",".join(METRIC_NAMES), help="of ttft,tpot,itl,e2el")
    out.add_argument("--metric-percentiles", default="90,99", help="e.g. 50,90,99")
    out.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS", help="SLOs, e.g. ttft:200 tpot:50")
    out.add_argument("--label", default=None, help="names the run in files, compare and plots")
    out.add_argument("--save-result", action="store_true")
    out.add_argument("--save-detailed", action="store_true", help="also per-request lists (ttfts, itls, ...)")
    out.add_argument("--result-dir", type=Path, default=None)
    out.add_argument("--result-filename", default=None)
    out.add_argument("--plot", action="store_true", help="PNGs next to the results (matplotlib)")


def _floats(text: str, flag: str) -> list[float]:
    try:
        values = [math.inf if v.strip() == "inf" else float(v) for v in text.split(",")]
    except ValueError:
        raise BenchError(f"{flag} takes numbers separated by commas (got {text!r})") from None
    if any(v <= 0 for v in values):
        raise BenchError(f"{flag} values must be positive")
    return values


def serve_main(args: argparse.Namespace) -> int:
    try:
        goodput = parse_goodput(args.goodput or [])
    except ValueError as e:
        raise BenchError(str(e)) from None
    percentile_metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    if unknown := set(percentile_metrics) - set(METRIC_NAMES):
        raise BenchError(f"--percentile-metrics: unknown {sorted(unknown)}; choose from {', '.join(METRIC_NAMES)}")
    percentiles = _floats(args.metric_percentiles, "--metric-percentiles")
    rates = _floats(args.request_rate, "--request-rate")
    concurrencies: list[int | None] = ([int(c) for c in _floats(args.max_concurrency, "--max-concurrency")]
                                       if args.max_concurrency else [None])
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    session_mode = args.dataset_name in SESSION_DATASETS
    endpoint = args.endpoint or (_CHAT_ENDPOINT if args.backend == "openai-chat" or session_mode
                                 else "/v1/completions")
    if session_mode and not endpoint.rstrip("/").endswith(_CHAT_ENDPOINT):
        raise BenchError(f"--dataset-name {args.dataset_name} sends chats with the server's replies in them: it "
                         f"needs --endpoint {_CHAT_ENDPOINT} (got {endpoint})")
    model = args.model or first_model(base_url, args.api_key)
    tokenizer_id = args.tokenizer or (model if Path(model).exists() else None)
    try:
        tokenizer = load_tokenizer(tokenizer_id) if tokenizer_id else None
    except ValueError as e:
        raise BenchError(str(e)) from None

    workload = _workload(args, tokenizer, args.seed)
    extra = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p), ("top_k", args.top_k))
             if v is not None}
    settings = RequestSettings(api_url=base_url + endpoint, model=args.served_model_name or model,
                               ignore_eos=args.ignore_eos or args.dataset_name in _SYNTHETIC, extra_body=extra,
                               api_key=args.api_key)
    sweep = len(rates) * len(concurrencies) > 1
    runs: list[tuple[str, dict[str, Any]]] = []
    for rate in rates:
        for concurrency in concurrencies:
            if args.sweep_fresh_prompts and runs:
                workload = _workload(args, tokenizer, args.seed + len(runs))
            print(f"--- request rate {rate:g}/s, max concurrency {concurrency}, {workload.num_requests} requests "
                  f"({args.dataset_name}) -> {settings.api_url}", flush=True)
            load = LoadSettings(request_rate=rate, burstiness=args.burstiness, max_concurrency=concurrency,
                                max_active_sessions=args.max_active_sessions, num_warmups=args.num_warmups,
                                seed=args.seed, request_timeout_s=args.request_timeout,
                                disable_tqdm=args.disable_tqdm)
            try:
                run = workload.run(settings, load)
            except ValueError as e:
                raise BenchError(str(e)) from None
            metrics = calculate_metrics(run.outputs, run.duration, percentiles, goodput)
            info = RunInfo(backend=args.backend, label=args.label, model_id=model, tokenizer_id=tokenizer_id,
                           num_prompts=workload.num_requests, request_rate=rate, max_concurrency=concurrency,
                           dataset_name=args.dataset_name, endpoint=endpoint, burstiness=args.burstiness)
            result = build_result(info, metrics, run.outputs, percentile_metrics, detailed=True)
            print(format_report(result, metrics, percentile_metrics), flush=True)
            name = _file_name(args, info, result["date"], sweep)
            runs.append((Path(name).stem, result))
            if args.plot:
                _plot(args, [(Path(name).stem, result)], Path(name).stem + "-distributions.png")
            if not args.save_detailed:
                for key in DETAILED_KEYS:
                    result.pop(key, None)
            if args.save_result:
                path = (args.result_dir or Path(".")) / name
                save_result(result, path)
                print(f"saved {path}")
    if sweep:
        print(compare_table(runs))
        if args.plot:
            _plot(args, runs, f"{args.label or args.backend}-sweep.png", sweep=True)
    return 0 if all(r["completed"] for _, r in runs) else 1


@dataclass(frozen=True)
class Workload:
    """One run's requests: independent ones, or (multi-turn-session) sessions sent turn by turn."""

    samples: list[SampleRequest]
    sessions: list[Session]

    @property
    def num_requests(self) -> int:
        return len(self.samples) + sum(len(s.turns) for s in self.sessions)

    def run(self, settings: RequestSettings, load: LoadSettings) -> RunOutput:
        if self.sessions:
            return asyncio.run(run_sessions(self.sessions, settings, load))
        return asyncio.run(run_requests(self.samples, settings, load))


def _workload(args: argparse.Namespace, tokenizer: Tokenizer | None, seed: int) -> Workload:
    config = DatasetConfig(
        name=args.dataset_name, num_prompts=args.num_prompts, seed=seed, input_len=args.input_len,
        output_len=args.output_len, range_ratio=args.random_range_ratio, prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes, num_turns=args.num_turns, system_prompt_len=args.system_prompt_len,
        think_time_s=args.think_time_s, dataset_path=args.dataset_path)
    try:
        if args.dataset_name in SESSION_DATASETS:
            return Workload(samples=[], sessions=get_sessions(config, tokenizer))
        return Workload(samples=get_samples(config, tokenizer), sessions=[])
    except ValueError as e:
        raise BenchError(str(e)) from None


def _file_name(args: argparse.Namespace, info: RunInfo, date: str, sweep: bool) -> str:
    if not args.result_filename:
        return result_filename(info, date)
    if not sweep:
        return str(args.result_filename)
    stem, suffix = Path(args.result_filename).stem, Path(args.result_filename).suffix or ".json"
    rate = "inf" if math.isinf(info.request_rate) else f"{info.request_rate:g}"
    concurrency = f"-concurrency{info.max_concurrency}" if info.max_concurrency is not None else ""
    return f"{stem}-{rate}qps{concurrency}{suffix}"


def _plot(args: argparse.Namespace, runs: list[tuple[str, dict[str, Any]]], name: str, sweep: bool = False
          ) -> None:
    from benchmark.plots import plot_distributions, plot_sweep

    path = (args.result_dir or Path(".")) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        written = plot_sweep(runs, path) if sweep else plot_distributions(runs, path)
    except ValueError as e:
        print(f"no plot: {e}")
        return
    if written:
        print(f"plotted {written}")


def first_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise BenchError(f"no --model given and {base_url}/v1/models did not name one: {e}") from None


def compare_main(args: argparse.Namespace) -> int:
    try:
        results = [(path.stem, load_result(path)) for path in args.result_files]
    except ValueError as e:
        raise BenchError(str(e)) from None
    print(compare_table([(r.get("label") or name, r) for name, r in results], markdown=args.markdown))
    return 0


def plot_main(args: argparse.Namespace) -> int:
    from benchmark.plots import plot_distributions, plot_sweep

    try:
        results = [(r.get("label") or path.stem, r) for path in args.result_files for r in [load_result(path)]]
        args.output_dir.mkdir(parents=True, exist_ok=True)
        written = [plot_sweep(results, args.output_dir / "sweep.png"),
                   plot_distributions(results, args.output_dir / "distributions.png")]
    except ValueError as e:
        raise BenchError(str(e)) from None
    for path in written:
        if path:
            print(f"plotted {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmark serve ...`: the same commands without the `tandem` entry point."""
    parser = argparse.ArgumentParser(prog="tandem bench")
    add_bench_commands(parser)
    args = parser.parse_args(argv)
    try:
        return int(args.bench_main(args))
    except BenchError as e:
        print(f"tandem bench {args.bench_command}: {e}", file=sys.stderr)
        return 2
