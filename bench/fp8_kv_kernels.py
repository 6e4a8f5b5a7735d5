"""The FP8 KV cache's kernels on a GPU: correctness against the torch twins, then decode attention over e4m3 K/V
against bf16 K/V at the Llama-3.1-8B attention shape (32 query heads, 8 KV heads, head dim 128, blocks of 16).

    python3 bench/fp8_kv_kernels.py [--batch 64] [--context 8192] [--out results.md]

Checks (fail loudly): the store kernel writes exactly the twin's bytes (values and scale bytes); decode and prefill
attention over an FP8 cache agree with the twins. Timing: one layer's paged decode attention (the Triton kernel,
CUDA events, best of several runs) on a bf16 cache and on an FP8 cache, with the bytes each reads and the rate.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.kernels import reference  # noqa: E402
from engine.kernels.decode import paged_decode_attention  # noqa: E402
from engine.kernels.kv_store import store_kv  # noqa: E402
from engine.kernels.prefill import paged_prefill_attention  # noqa: E402
from engine.layers import kv_fp8  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def fp8_layer(num_blocks: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    pool, views = kv_fp8.allocate_fp8_pool(num_blocks, 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM, "cuda")
    return pool, views[0]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def check_correctness() -> list[str]:
    torch.manual_seed(0)
    num_tokens = 4096
    num_blocks = 2 * num_tokens // BLOCK_SIZE
    pool, (k_cache, v_cache, k_scale, v_scale) = fp8_layer(num_blocks)
    twin_pool, (tk, tv, tks, tvs) = fp8_layer(num_blocks)
    rows = torch.randn(num_tokens, 2 * KV_HEADS, HEAD_DIM, device="cuda") * torch.exp2(
        torch.randint(-20, 21, (num_tokens, 2 * KV_HEADS, 1), device="cuda").float())
    rows = rows.bfloat16()
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:num_tokens]
    store_kv(rows[:, :KV_HEADS], rows[:, KV_HEADS:], k_cache, v_cache, slots, k_scale, v_scale)
    reference.store_kv(rows[:, :KV_HEADS], rows[:, KV_HEADS:], tk, tv, slots, tks, tvs)
    mismatched = int((pool != twin_pool).sum())
    assert mismatched == 0, f"store kernel: {mismatched} bytes differ from the twin's"
    lines = [f"store kernel: {pool.numel()} bytes equal the twin's (values and scales)"]

    seq_lens = [1, 300, 2000, 777]
    query_lens = [1, 64, 300, 129]
    needed = sum(-(-n // BLOCK_SIZE) for n in seq_lens)
    pool, (k_cache, v_cache, k_scale, v_scale) = fp8_layer(needed + 1)
    context = torch.randn((needed + 1) * BLOCK_SIZE, 2 * KV_HEADS, HEAD_DIM, device="cuda").bfloat16()
    store_kv(context[:, :KV_HEADS], context[:, KV_HEADS:], k_cache, v_cache,
             torch.arange(context.shape[0], device="cuda"), k_scale, v_scale)
    ids = torch.randperm(needed, device="cuda").int() + 1
    width = max(-(-n // BLOCK_SIZE) for n in seq_lens)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32, device="cuda")
    used = 0
    for b, n in enumerate(seq_lens):
        count = -(-n // BLOCK_SIZE)
        tables[b, :count] = ids[used:used + count]
        used += count
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    scale = HEAD_DIM ** -0.5
    q = torch.randn(len(seq_lens), HEADS, HEAD_DIM, device="cuda").bfloat16()
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, None, k_scale=k_scale, v_scale=v_scale)
    expected = reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, None, k_scale, v_scale)
    decode_error = relative_error(out, expected)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], HEADS, HEAD_DIM, device="cuda").bfloat16()
    starts_d = torch.tensor(starts, dtype=torch.int32, device="cuda")
    out = paged_prefill_attention(q, k_cache, v_cache, tables, starts_d, lens, scale, None, k_scale=k_scale,
                                  v_scale=v_scale)
    expected = reference.paged_prefill_attention(q, k_cache, v_cache, tables, starts_d, lens, scale, None, k_scale,
                                                 v_scale)
    prefill_error = relative_error(out, expected)
    # bf16 outputs of float32 math: the kernels' tolerance for bf16 (tests/kernels/paged.py)
    assert decode_error < 2e-2 and prefill_error < 2e-2, (decode_error, prefill_error)
    lines.append(f"decode attention on FP8 K/V vs the twin: relative error {decode_error:.2e}; prefill "
                 f"{prefill_error:.2e} (bf16 outputs)")
    return lines


def time_decode(batch: int, context: int, fp8: bool, repeats: int = 20) -> tuple[float, int]:
    """(seconds per call, bytes of K/V read) of one layer's decode attention."""
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1
    if fp8:
        _, (k_cache, v_cache, k_scale, v_scale) = fp8_layer(num_blocks)
        k_cache.view(torch.uint8).random_(0, 0x7F)  # finite e4m3 bytes
        v_cache.view(torch.uint8).random_(0, 0x7F)
        k_scale.fill_(127)
        v_scale.fill_(127)
        kv_bytes = batch * context * 2 * KV_HEADS * (HEAD_DIM + 1)
        scales: dict[str, torch.Tensor] = {"k_scale": k_scale, "v_scale": v_scale}
    else:
        cache = torch.randn(num_blocks, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda").bfloat16()
        k_cache, v_cache = cache[:, 0], cache[:, 1]
        kv_bytes = batch * context * 2 * KV_HEADS * HEAD_DIM * 2
        scales = {}
    tables = (torch.randperm(num_blocks - 1, device="cuda")[:batch * blocks_per_seq] + 1).int().view(batch, -1)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda").bfloat16()
    out = torch.empty_like(q)

    def run() -> None:
        paged_decode_attention(q, k_cache, v_cache, tables, lens, HEAD_DIM ** -0.5, None, out=out, **scales)

    for _ in range(3):
        run()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            run()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / repeats)
    return best, kv_bytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lines = [f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}", *check_correctness(), "",
             f"one layer's paged decode attention, batch {args.batch}, context {args.context}, {HEADS}/{KV_HEADS} "
             f"heads, head dim {HEAD_DIM}, blocks of {BLOCK_SIZE}:", "",
             "| KV cache | us/call | K/V bytes read | GB/s |", "|---|---|---|---|"]
    results = {}
    for name, fp8 in (("bf16", False), ("fp8 (e4m3 + scale byte per row)", True)):
        seconds, kv_bytes = time_decode(args.batch, args.context, fp8)
        results[name] = seconds
        lines.append(f"| {name} | {seconds * 1e6:.1f} | {kv_bytes / 1e9:.3f} GB | {kv_bytes / seconds / 1e9:.0f} |")
        torch.cuda.empty_cache()
    bf16, fp8_time = results.values()
    lines += ["", f"fp8 / bf16 time: {fp8_time / bf16:.2f}"]
    report = "\n".join(lines)
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")


if __name__ == "__main__":
    main()
