"""What one MoE block costs in communication per step, measured: collectives and the bytes each rank sends, for
TP-sharded experts and for expert parallelism, on gloo ranks of this machine (CPU).

    python bench/moe_comm.py [--ranks 2] [--tokens 1,64,512,4096] [--dtype bfloat16]

The block is Qwen3-30B-A3B's (hidden 2048, 128 experts, top-8) except for a small expert intermediate size
(16): what crosses between ranks does not depend on it, and the real one would not fit this box. Every
torch.distributed call the block makes is counted with the bytes of the tensor this rank passes in (for an
all-to-all, the rows it sends away plus the ones it keeps). Random router weights spread tokens about evenly.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import MoeConfig  # noqa: E402
from engine.layers.moe import SparseMoeBlock  # noqa: E402
from engine.parallel.context import ParallelContext  # noqa: E402

HIDDEN = 2048
MODES = ("tp_sharded", "ep_allgather_reducescatter", "ep_all_to_all")
MOE = MoeConfig(num_experts=128, num_experts_per_tok=8, intermediate_size=16, norm_topk_prob=True)


def _counting(calls: Counter[str], num_bytes: Counter[str]) -> None:
    """Wraps the collectives the block uses so each call adds to `calls` and `num_bytes`."""
    for name, tensor_arg in (("all_reduce", 0), ("all_to_all_single", 1), ("all_gather", 1)):
        original = getattr(dist, name)

        def wrapped(*args: Any, _name: str = name, _original: Any = original, _arg: int = tensor_arg,
                    **kwargs: Any) -> Any:
            tensor = args[_arg]
            if isinstance(tensor, list):
                tensor = tensor[0]
            calls[_name] += 1
            num_bytes[_name] += tensor.numel() * tensor.element_size()
            return _original(*args, **kwargs)

        setattr(dist, name, wrapped)


def _rank(rank: int, num_ranks: int, port: int, token_counts: list[int], dtype_name: str, out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_ranks)
    calls: Counter[str] = Counter()
    num_bytes: Counter[str] = Counter()
    _counting(calls, num_bytes)
    dtype = getattr(torch, dtype_name)
    results = []
    for mode in MODES:
        expert_parallel = mode.startswith("ep_")
        parallel = ParallelContext(tp_rank=rank, tp_size=num_ranks, expert_parallel=expert_parallel,
                                   group=dist.group.WORLD,
                                   all2all_backend=mode.removeprefix("ep_") if expert_parallel else
                                   "allgather_reducescatter")
        torch.manual_seed(0)  # the same router on every rank, as a checkpoint gives it
        block = SparseMoeBlock(HIDDEN, MOE, round_weights=True, parallel=parallel)
        with torch.no_grad():
            for param in block.parameters():
                param.normal_(0, 0.05)
        block.to(dtype)
        for num_tokens in token_counts:
            x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(num_tokens)).to(dtype)
            calls.clear()
            num_bytes.clear()
            with torch.no_grad():
                block(x)
            results.append({"mode": mode, "tokens": num_tokens, "rank": rank, "calls": dict(calls),
                            "bytes": dict(num_bytes), "total_calls": sum(calls.values()),
                            "total_bytes": sum(num_bytes.values())})
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", default="1,64,512,4096")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out", default=None, help="write the per-rank results as JSON here")
    args = parser.parse_args()
    token_counts = [int(t) for t in args.tokens.split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(args.ranks, port, token_counts, args.dtype, Path(tmp)), nprocs=args.ranks,
                           start_method="spawn", join=True)
        results = [r for rank in range(args.ranks)
                   for r in json.loads((Path(tmp) / f"rank{rank}.json").read_text())]
    print(f"one MoE block, {args.ranks} ranks, hidden {HIDDEN}, {MOE.num_experts} experts, "
          f"top-{MOE.num_experts_per_tok}, {args.dtype}: collectives and bytes sent per rank (max over ranks)")
    for mode in MODES:
        for num_tokens in token_counts:
            rows = [r for r in results if r["mode"] == mode and r["tokens"] == num_tokens]
            worst = max(rows, key=lambda r: r["total_bytes"])
            print(f"{mode:26s} T={num_tokens:5d}: {worst['total_calls']} collectives {worst['calls']}, "
                  f"{worst['total_bytes'] / 1e6:9.3f} MB {worst['bytes']}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
