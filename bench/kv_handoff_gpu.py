"""KV handoff bandwidth: two processes on one GPU, engine-shaped bf16 KV pools, per transfer backend.

The pools have the engine's KV layout (docs/architecture.md#kv-layout).

    python bench/kv_handoff_gpu.py [--device cuda|cpu] [--backends nixl,nixl-write,ipc,mooncake]
        [--prompt-tokens 1024,4096,16384] [--repeats 20] [--warmup 3] [--json FILE]
        [--variant 'name=NAME ucx_config=KEY=VALUE,... env:NAME=VALUE ...'] ... [--ucx-devices lo]
        [--mooncake-protocol tcp] [--job-timeout 240] [--devices P,D]

Each pool is laid out like the engine's KV cache, block-major [num_blocks, num_layers, 2, block_size, kv_heads,
head_dim], Llama-3.1-8B shaped (32 layers, 8 KV heads of 128, blocks of 16 tokens: 2 MiB a block), filled with
random values. For prompts of 1k, 4k and 16k tokens (64, 256, 1024 blocks) the decode process D moves the prompt's
blocks out of the prefill process P's pool into its own:
- scattered: block ids as a pool under load hands them out. Each pool is cut into runs of 1-4 consecutive blocks
  in shuffled order (a free list after churn), independently on P and D, so a transfer is mostly short runs;
- contiguous: one run on both sides (the best case, one descriptor).
Per backend of `--backends`: `nixl`, `ipc`, `mooncake` (any kvtransfer backend: a READ through our connector,
timed from `read()` until `poll()` answers DONE), `nixl-write` (a WRITE of the same bytes over the same
descriptors with the raw NIXL API: not part of the connector contract, for the figure only). A backend that cannot
start (not installed, no VRAM support) is listed as skipped with the reason. Every case is verified once, with
per-block digests on the device on both sides, after D's blocks were overwritten with fresh random values.
Baseline, measured the same way in one process: `copy`, the same blocks moved by one device `copy_` per run (one
for the contiguous case); each row's "x copy" is its bandwidth over the contiguous copy of the same bytes.

Variants: each `--variant` runs the NIXL rows again with its own UCX settings (`ucx_config=`, handed to the
connector as TransportSettings.ucx_config, on top of the VRAM default CUDA_IPC_ENABLE_GET_ZCOPY=y) and its own
process environment (`env:NAME=VALUE`, for what NIXL cannot take as a setting, e.g. `env:UCX_TLS=cuda_ipc,
cuda_copy,tcp`). This launcher sets that environment in P and D before they import a transport library, along
with NIXL_LOG_LEVEL=WARN and UCX_MODULES=^ib (one machine, no InfiniBand: docs/environment.md#ucx-and-nixl). The
other backends and the baseline run under the first variant only. Default: one variant, "default" (the connector's
own settings).

Two GPUs: `--devices 0,1` puts P's pool on cuda:0 and D's on cuda:1 (default 0,0: one GPU); the baseline is then a
plain device-to-device copy between the two GPUs (source pool on P's GPU, `copy_` into D's), and "x copy" compares
each backend with it (issue 17's goal: >= 0.8 of it). For Mooncake between GPUs, its intra-node CUDA IPC transport:
`--backends mooncake --mooncake-protocol nvlink_intra --variant 'name=nvlink_intra env:MC_INTRANODE_NVLINK=1'`.

`--device cpu` runs the same on host memory (2-layer blocks of 128 KiB, 256 and 1024 tokens) as a smoke test.
Bandwidth in GB/s (1e9 bytes/s). Prints a markdown table last; `--json FILE` writes rows, skips and settings.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import shlex
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kv_handoff_worker import BLOCK_SIZE, Case, WorkerSpec, measure, serve  # noqa: E402
from kvtransfer import BACKENDS, InvalidRequestError  # noqa: E402
from kvtransfer.ucx_config import parse_ucx_config  # noqa: E402
from settings.cluster import TransportSettings  # noqa: E402

NIXL_ROWS = ("nixl", "nixl-write")
BASE_ENV = {"NIXL_LOG_LEVEL": "WARN", "MC_LOG_LEVEL": "WARNING", "UCX_MODULES": "^ib"}


@dataclass(frozen=True)
class Variant:
    name: str
    ucx_config: str | None = None
    env: dict[str, str] = field(default_factory=dict)


def parse_variant(text: str) -> Variant:
    """'name=N ucx_config=K=V,K=V env:NAME=VALUE ...' (shell quoting) -> Variant; SystemExit on anything else."""
    name, ucx_config, env = "", None, {}
    for token in shlex.split(text):
        key, equals, value = token.partition("=")
        if key == "name" and equals and value:
            name = value
        elif key == "ucx_config" and equals:
            try:
                parse_ucx_config(value)
            except InvalidRequestError as e:
                raise SystemExit(f"--variant {text!r}: {e}") from None
            ucx_config = value
        elif key.startswith("env:") and equals and key[4:]:
            env[key[4:]] = value
        else:
            raise SystemExit(f"--variant {text!r}: expected name=NAME, ucx_config=K=V,... or env:NAME=VALUE, "
                             f"got {token!r}")
    if not name:
        raise SystemExit(f"--variant {text!r}: give it a name=NAME")
    return Variant(name, ucx_config, env)


def scattered_ids(rng: np.random.Generator, pool_blocks: int, num_blocks: int) -> np.ndarray:
    """`num_blocks` ids as a free list after churn hands them out: the pool cut into runs of 1-4 consecutive
    blocks, the runs shuffled, taken in order."""
    lengths = rng.integers(1, 5, size=pool_blocks)
    starts = np.concatenate(([0], np.cumsum(lengths)))
    starts = starts[starts < pool_blocks]
    runs = [np.arange(start, min(start + length, pool_blocks)) for start, length in zip(starts, lengths, strict=False)]
    return np.concatenate([runs[i] for i in rng.permutation(len(runs))])[:num_blocks]


def make_cases(prompt_tokens: list[int], pool_blocks: int, seed: int) -> tuple[Case, ...]:
    rng = np.random.default_rng(seed)
    cases = []
    for tokens in prompt_tokens:
        n = tokens // BLOCK_SIZE
        cases.append(Case(tokens, "scattered", tuple(scattered_ids(rng, pool_blocks, n).tolist()),
                          tuple(scattered_ids(rng, pool_blocks, n).tolist())))
        cases.append(Case(tokens, "contiguous", tuple(range(n)), tuple(range(pool_blocks - n, pool_blocks))))
    return tuple(cases)


def run_worker(spec: WorkerSpec, timeout_s: float) -> tuple[list[dict[str, Any]] | None, str | None]:
    """Runs P (unless `copy`) and D in spawned processes; (rows, None) or (None, why it failed). Processes still
    there `timeout_s` after the start are killed."""
    context = multiprocessing.get_context("spawn")
    results, results_child = context.Pipe()
    p_link, d_link = context.Pipe() if spec.backend != "copy" else (None, None)
    server = context.Process(target=serve, args=(p_link, spec), daemon=True) if p_link is not None else None
    client = context.Process(target=measure, args=(results_child, d_link, spec), daemon=True)
    for process in (server, client):
        if process is not None:
            process.start()
    try:
        if not results.poll(timeout_s):
            return None, f"no answer in {timeout_s:g} s (D alive: {client.is_alive()})"
        try:
            kind, payload = results.recv()
        except EOFError:
            client.join(5)
            return None, f"D died (exit code {client.exitcode})"
        return (payload, None) if kind == "done" else (None, payload)
    finally:
        for process in (client, server):
            if process is not None:
                process.join(30)
                if process.is_alive():
                    process.kill()
                    process.join(5)


def connector_options(backend: str, variant: Variant, args: argparse.Namespace) -> dict[str, Any]:
    """The connector's keyword options, built as a node builds them: from the cluster's TransportSettings."""
    transport = TransportSettings(ucx_devices=args.ucx_devices, ucx_config=variant.ucx_config,
                                  mooncake_protocol=args.mooncake_protocol)
    return transport.connector_options("nixl" if backend in NIXL_ROWS else backend)


def markdown(rows: list[dict[str, Any]], skipped: list[dict[str, str]]) -> str:
    lines = ["| variant | backend | op | tokens | layout | blocks | descriptors | MiB | median ms | median GB/s "
             "| best GB/s | x copy | verified |", "|" + "---|" * 13]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['backend']} | {r['op']} | {r['tokens']} | {r['layout']} | {r['blocks']} "
                     f"| {r['descriptors']} | {r['bytes'] / 2**20:.0f} | {r['median_ms']:.3f} "
                     f"| {r['median_gb_s']:.1f} | {r['best_gb_s']:.1f} | {r['x_copy']:.3f} | {r['verified']} |")
    if skipped:
        lines.append("")
    lines += [f"skipped: {s['variant']} {s['backend']}: {s['reason'].splitlines()[0]}" for s in skipped]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--backends", default=",".join((*BACKENDS, "nixl-write")),
                        help=f"comma-separated, of {', '.join((*BACKENDS, 'nixl-write'))} (default: all)")
    parser.add_argument("--prompt-tokens", help="comma-separated (default: 1024,4096,16384; cpu: 256,1024)")
    parser.add_argument("--num-layers", type=int, help="default 32 (cpu: 2)")
    parser.add_argument("--pool-blocks", type=int, help="blocks per pool (default: twice the largest prompt's)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--variant", action="append", type=parse_variant, default=[])
    parser.add_argument("--ucx-devices", default="lo", help="NIXL's ucx_devices (default lo: one machine)")
    parser.add_argument("--mooncake-protocol", default="tcp")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--job-timeout", type=float, default=240.0,
                        help="seconds one backend's processes may take before they are killed (default 240)")
    parser.add_argument("--devices", default="0,0", help="P's GPU and D's, e.g. 0,1 (cuda only; default 0,0)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    try:
        prefill_index, decode_index = (int(i) for i in args.devices.split(","))
    except ValueError:
        parser.error(f"--devices takes two GPU indices, P's and D's, e.g. 0,1 (got {args.devices!r})")
    if args.device == "cpu" and (prefill_index, decode_index) != (0, 0):
        parser.error("--devices is for --device cuda")
    on_cpu = args.device == "cpu"
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    prompt_tokens = [int(t) for t in (args.prompt_tokens or ("256,1024" if on_cpu else "1024,4096,16384")).split(",")]
    if any(t <= 0 or t % BLOCK_SIZE for t in prompt_tokens):
        parser.error(f"prompt tokens must be positive multiples of the block size {BLOCK_SIZE}")
    pool_blocks = args.pool_blocks or 2 * max(prompt_tokens) // BLOCK_SIZE
    if pool_blocks < max(prompt_tokens) // BLOCK_SIZE:
        parser.error("--pool-blocks must hold the largest prompt")
    variants = args.variant or [Variant("default")]
    base = WorkerSpec(backend="copy", device=args.device, num_layers=args.num_layers or (2 if on_cpu else 32),
                      pool_blocks=pool_blocks, cases=make_cases(prompt_tokens, pool_blocks, args.seed),
                      warmup=args.warmup, repeats=args.repeats, prefill_device_index=prefill_index,
                      decode_device_index=decode_index)

    rows: list[dict[str, Any]] = []
    # a backend this checkout lacks (e.g. "ipc" before it lands) is a skip, so one command line fits every branch
    skipped = [{"variant": variants[0].name, "backend": b, "reason": f"not a kvtransfer backend here ({BACKENDS})"}
               for b in backends if b not in (*BACKENDS, "nixl-write")]
    backends = [b for b in backends if b in (*BACKENDS, "nixl-write")]
    jobs = [(variants[0], "copy")] + [(v, b) for v in variants for b in backends if v is variants[0] or b in NIXL_ROWS]
    for variant, backend in jobs:
        spec = replace(base, backend=backend, env={**BASE_ENV, **variant.env},
                       connector_options=connector_options(backend, variant, args))
        print(f"[{variant.name}] {backend} ...", file=sys.stderr, flush=True)
        result, reason = run_worker(spec, args.job_timeout)
        if result is None:
            skipped.append({"variant": variant.name, "backend": backend, "reason": reason or "?"})
            print(f"[{variant.name}] {backend} skipped: {reason}", file=sys.stderr, flush=True)
            continue
        rows += [{"variant": variant.name, "env": spec.env, "connector_options": spec.connector_options, **row}
                 for row in result]
    contiguous_copy = {r["tokens"]: r["median_gb_s"] for r in rows if r["op"] == "copy" and r["layout"] == "contiguous"}
    for row in rows:
        row["x_copy"] = row["median_gb_s"] / contiguous_copy[row["tokens"]] if row["tokens"] in contiguous_copy else 0.0
    if args.json:
        meta = {"device": args.device, "devices": args.devices, "host": platform.node(), "argv": sys.argv[1:],
                "pool_blocks": pool_blocks,
                "num_layers": base.num_layers, "block_size": BLOCK_SIZE, "repeats": args.repeats,
                "warmup": args.warmup, "variants": [vars(v) for v in variants], "versions": versions()}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows, "skipped": skipped}, indent=2) + "\n")
    print(f"P's pool on {base.torch_device('prefill')}, D's on {base.torch_device('decode')}; x copy: over the "
          "contiguous copy between the same two pools", file=sys.stderr)
    print(markdown(rows, skipped))


def versions() -> dict[str, str]:
    from importlib import metadata

    found = {}
    for name in ("torch", "nixl", "nixl-cu13", "nixl-cu12", "mooncake-transfer-engine",
                 "mooncake-transfer-engine-cuda13", "mooncake-transfer-engine-non-cuda"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


if __name__ == "__main__":
    main()
