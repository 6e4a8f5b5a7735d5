"""The fused MoE kernel on a Qwen3-30B-A3B-shaped layer, against a dense grouped-GEMM reference and the HBM floor.

    python3 bench/moe_kernel.py [--tokens 1,64,512,4096] [--sweep] [--out results.json]

Layer: hidden 2048, 128 experts, top-8, moe_intermediate 768, bf16, router probabilities from random logits
(about uniform over experts). Per token count it times, with triton.testing (CUDA-graph replay where the code
allows it, so launch overheads of the small torch ops count as on a captured decode step):

- fused: engine/kernels/moe.py's fused_moe (align + gate_up/SiLU kernel + down kernel + combine);
- grouped_mm: torch._grouped_mm over the same expert-sorted rows (gate_up, SiLU-and-mul, down, weighted
  combine), when this torch has it; else skipped;
- loop: one torch matmul pair per expert over its rows (what transformers' eager experts do);
- floor: bytes the layer must read (the weights of every expert some token picked, plus x and the output)
  / 4.2 TB/s (the H200's measured HBM read rate, docs/environment.md#gpus).

Every result is checked against the float32 torch twin (relative error). `--sweep` also times a few other tile
shapes of the fused kernel and reports the best, to tune engine/kernels/moe.py's pick_tiles.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.kernels import reference  # noqa: E402
from engine.kernels.moe import MoeTiles, fused_moe, pick_tiles  # noqa: E402

HIDDEN, NUM_EXPERTS, TOP_K, INTERMEDIATE = 2048, 128, 8, 768
HBM_BYTES_PER_S = 4.2e12
SWEEP = [MoeTiles(16, 64, 128, 4, 4), MoeTiles(16, 128, 64, 4, 4), MoeTiles(32, 64, 128, 4, 4),
         MoeTiles(64, 64, 64, 4, 4), MoeTiles(64, 128, 64, 8, 4), MoeTiles(128, 128, 64, 8, 3),
         MoeTiles(128, 256, 64, 8, 3)]


def timed_us(fn: Callable[[], object], graph: bool) -> float:
    if graph:
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3
        except Exception as exc:  # noqa: BLE001 - a code path that cannot be captured is timed eagerly
            print(f"  (not capturable: {type(exc).__name__}: {exc}; timed eagerly)", flush=True)
    return triton.testing.do_bench(fn, warmup=10, rep=100) * 1e3


def sorted_rows(topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair order sorted by expert, rows per expert)."""
    flat = topk_ids.reshape(-1)
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=NUM_EXPERTS)


def grouped_mm_moe(x: torch.Tensor, w13_t: torch.Tensor, w2_t: torch.Tensor, weights: torch.Tensor,
                   order: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm over the expert-sorted rows. w13_t: [E, H, 2I]; w2_t: [E, I, H] (transposed views)."""
    rows = x[order // TOP_K]
    gate_up = torch._grouped_mm(rows, w13_t, offs=offsets)
    gate, up = gate_up.chunk(2, dim=-1)
    down = torch._grouped_mm(F.silu(gate) * up, w2_t, offs=offsets)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, order // TOP_K, down.float() * weights.reshape(-1)[order, None])
    return out.to(x.dtype)


def loop_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, order: torch.Tensor,
             counts: list[int]) -> torch.Tensor:
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            pairs = order[start:start + count]
            tokens = pairs // TOP_K
            gate, up = (x[tokens] @ w13[expert].t()).chunk(2, dim=-1)
            down = (F.silu(gate) * up) @ w2[expert].t()
            out.index_add_(0, tokens, down.float() * weights.reshape(-1)[pairs, None])
            start += count
    return out.to(x.dtype)


def rel_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.float() - expected).norm() / expected.norm())


def run(num_tokens: int, sweep: bool) -> dict[str, object]:
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
    w13 = (torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, device="cuda", generator=gen) * HIDDEN ** -0.5).bfloat16()
    w2 = (torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, device="cuda", generator=gen)
          * INTERMEDIATE ** -0.5).bfloat16()
    logits = torch.randn(num_tokens, NUM_EXPERTS, device="cuda", generator=gen)
    weights, ids = logits.softmax(dim=-1).topk(TOP_K, dim=-1)
    expected = reference.fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
    order, counts = sorted_rows(ids)
    experts_hit = int((counts > 0).sum())
    weight_bytes = experts_hit * 3 * HIDDEN * INTERMEDIATE * 2
    floor_us = (weight_bytes + 2 * num_tokens * HIDDEN * 2) / HBM_BYTES_PER_S * 1e6
    flops = 2 * num_tokens * TOP_K * 3 * HIDDEN * INTERMEDIATE
    result: dict[str, object] = {"tokens": num_tokens, "experts_hit": experts_hit, "floor_us": floor_us,
                                 "tiles": pick_tiles(num_tokens * TOP_K, NUM_EXPERTS, x.device).__dict__}

    fused = fused_moe(x, w13, w2, weights, ids)
    result["fused_error"] = rel_error(fused, expected)
    result["fused_us"] = timed_us(lambda: fused_moe(x, w13, w2, weights, ids), graph=True)
    if sweep:
        best: tuple[float, MoeTiles] | None = None
        for tiles in SWEEP:
            try:
                err = rel_error(fused_moe(x, w13, w2, weights, ids, tiles=tiles), expected)
                us = timed_us(lambda t=tiles: fused_moe(x, w13, w2, weights, ids, tiles=t), graph=True)
            except Exception as exc:  # noqa: BLE001 - a tile shape the GPU cannot run is reported, not fatal
                print(f"  tiles {tiles}: {type(exc).__name__}: {exc}", flush=True)
                continue
            print(f"  tiles {tiles}: {us:9.1f} us  err {err:.2e}", flush=True)
            if err < 2e-2 and (best is None or us < best[0]):
                best = (us, tiles)
        if best is not None:
            result["best_sweep_us"], result["best_sweep_tiles"] = best[0], best[1].__dict__

    if hasattr(torch, "_grouped_mm"):
        offsets = counts.cumsum(0).to(torch.int32)
        w13_t, w2_t = w13.transpose(1, 2), w2.transpose(1, 2)
        try:
            grouped = grouped_mm_moe(x, w13_t, w2_t, weights, order, offsets)
            result["grouped_mm_error"] = rel_error(grouped, expected)
            result["grouped_mm_us"] = timed_us(lambda: grouped_mm_moe(x, w13_t, w2_t, weights, order, offsets),
                                               graph=True)
        except Exception as exc:  # noqa: BLE001 - reported, the other columns still run
            result["grouped_mm_failed"] = f"{type(exc).__name__}: {exc}"
    count_list = counts.tolist()
    result["loop_error"] = rel_error(loop_moe(x, w13, w2, weights, order, count_list), expected)
    result["loop_us"] = timed_us(lambda: loop_moe(x, w13, w2, weights, order, count_list), graph=False)

    fused_us = float(result["fused_us"])  # type: ignore[arg-type]
    result["fused_tb_per_s"] = (weight_bytes + 2 * num_tokens * HIDDEN * 2) / (fused_us * 1e-6) / 1e12
    result["fused_tflops"] = flops / (fused_us * 1e-6) / 1e12
    result["fused_over_floor"] = fused_us / floor_us
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="1,64,512,4096")
    parser.add_argument("--sweep", action="store_true", help="also time other tile shapes of the fused kernel")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}; "
          f"H={HIDDEN} E={NUM_EXPERTS} top-{TOP_K} I={INTERMEDIATE} bf16", flush=True)
    results = []
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        result = run(num_tokens, args.sweep)
        results.append(result)
        grouped = result.get("grouped_mm_us")
        print(f"T={num_tokens:5d} experts hit {result['experts_hit']:3d}  fused {result['fused_us']:9.1f} us "
              f"({result['fused_tb_per_s']:.2f} TB/s, {result['fused_tflops']:.0f} TFLOP/s, "
              f"{result['fused_over_floor']:.2f}x floor {result['floor_us']:.1f} us)  "
              f"grouped_mm {f'{grouped:9.1f} us' if grouped is not None else result.get('grouped_mm_failed', 'n/a')}"
              f"  loop {result['loop_us']:9.1f} us  errors fused {result['fused_error']:.1e} "
              f"grouped {result.get('grouped_mm_error', float('nan')):.1e} loop {result['loop_error']:.1e}",
              flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
