"""Which causal prefill attention reaches the issue's 550 TFLOP/s on this GPU (head dim 128, GQA 32/8, bf16)?

    python3 bench/h200/prefill_probe.py [--lengths 4096,8192,16384]

Times, per length, torch's SDPA under each backend it has (inputs as the engine holds them: [T, H, D] rows
seen as [1, H, T, D] views, K/V with 8 heads either shared natively (enable_gqa) or expanded to 32), and the
paged Triton kernel under a few configs. Each result is checked against the math backend in float32 on a
slice of rows. FLOPs = 4 * D * Hq * T * (T + 1) / 2.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

HQ, HKV, D, PAGE = 32, 8, 128, 16


def tflops(length: int, seconds: float) -> float:
    return 4 * D * HQ * length * (length + 1) / 2 / seconds / 1e12


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    return triton.testing.do_bench(fn, warmup=5, rep=40) / 1e3


def reference_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: slice) -> torch.Tensor:
    """float32 causal attention of query rows `rows` (of [T, H, D] inputs): [R, Hq, D]."""
    stop = rows.stop
    qf = q[rows].float().transpose(0, 1)[None]
    kf = k[:stop].float().repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)[None]
    vf = v[:stop].float().repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)[None]
    mask = torch.arange(stop, device=q.device)[None, :] <= torch.arange(rows.start, stop, device=q.device)[:, None]
    return F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask)[0].transpose(0, 1)


def error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected).norm() / expected.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="4096,8192,16384")
    args = parser.parse_args()
    import torch.nn.attention as attention

    for name in ("list_flash_attention_impls", "current_flash_attention_impl"):
        if hasattr(attention, name):
            try:
                print(f"{name}: {getattr(attention, name)()}", flush=True)
            except Exception as exc:  # noqa: BLE001 - a probe reports, it does not stop
                print(f"{name}: {type(exc).__name__}: {exc}", flush=True)
    from engine.kernels.prefill import PrefillConfig, paged_prefill_attention

    torch.manual_seed(0)
    for length in [int(x) for x in args.lengths.split(",")]:
        q = torch.randn(length, HQ, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(length, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(length, HKV, D, device="cuda", dtype=torch.bfloat16)
        check = slice(length - 64, length)
        expected = reference_rows(q, k, v, check)
        qv, kv, vv = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, H, T, D] views, no copy
        k_exp = k.repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)[None]
        v_exp = v.repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)[None]
        print(f"\n## T = {length}", flush=True)
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            for label, kk, vv2, gqa in (("gqa", kv, vv, True), ("expanded", k_exp, v_exp, False)):
                call = functools.partial(F.scaled_dot_product_attention, qv, kk, vv2, is_causal=True,
                                         enable_gqa=gqa)
                try:
                    with sdpa_kernel([backend]):
                        out = call()[0].transpose(0, 1)
                        seconds = timed(call)
                    print(f"sdpa {backend.name:20s} {label:9s} {tflops(length, seconds):6.0f} TFLOP/s "
                          f"({seconds * 1e3:.3f} ms) err {error(out[check], expected):.1e}", flush=True)
                except Exception as exc:  # noqa: BLE001
                    print(f"sdpa {backend.name:20s} {label:9s} failed: {type(exc).__name__}: {str(exc)[:160]}",
                          flush=True)
        # the paged kernel: K/V in a scattered paged cache
        num_pages = length // PAGE + 1
        k_cache = torch.zeros(num_pages * 2, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.zeros_like(k_cache)
        pages = torch.randperm(num_pages * 2, device="cuda")[:num_pages]
        k_cache[pages[:length // PAGE]] = k[:length // PAGE * PAGE].view(-1, PAGE, HKV, D)
        v_cache[pages[:length // PAGE]] = v[:length // PAGE * PAGE].view(-1, PAGE, HKV, D)
        table = pages.to(torch.int32)[None]
        starts = torch.tensor([0, length], dtype=torch.int32, device="cuda")
        lens = torch.tensor([length], dtype=torch.int32, device="cuda")
        # the engine's path: TritonAttention as a prefill step calls it (store_kv included), dense route on
        from engine.kernels.backend import TritonAttention
        from engine.layers.attention import AttentionMetadata

        slots = (pages[torch.arange(length, device="cuda") // PAGE] * PAGE
                 + torch.arange(length, device="cuda") % PAGE)
        meta = AttentionMetadata(slot_mapping=slots, query_start_loc=starts, seq_lens=lens, block_tables=table,
                                 num_decodes=0, query_start_loc_host=[0, length], seq_lens_host=[length])
        for label, min_tokens in (("dense", 1024), ("paged", 0)):
            step = functools.partial(TritonAttention(min_tokens).forward, q, k, v, k_cache, v_cache, meta, D ** -0.5)
            try:
                out = step()
                seconds = timed(step)
                print(f"engine backend ({label})             {tflops(length, seconds):6.0f} TFLOP/s "
                      f"({seconds * 1e3:.3f} ms) err {error(out[check], expected):.1e}", flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"engine backend ({label}) failed: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        for m, n, w, s in [(128, 128, 8, 3), (128, 128, 8, 2), (128, 128, 8, 4), (128, 64, 8, 3), (128, 64, 4, 3),
                           (64, 64, 4, 3), (128, 128, 4, 3), (256, 64, 8, 3), (128, 32, 4, 4)]:
            paged = functools.partial(paged_prefill_attention, q, k_cache, v_cache, table, starts, lens,
                                      D ** -0.5, None, max_query_len=length, config=PrefillConfig(m, n, w, s))
            try:
                out = paged()
                seconds = timed(paged)
                print(f"triton paged m{m} n{n} w{w} s{s}        {tflops(length, seconds):6.0f} TFLOP/s "
                      f"({seconds * 1e3:.3f} ms) err {error(out[check], expected):.1e}", flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"triton paged m{m} n{n} w{w} s{s} failed: {type(exc).__name__}: {str(exc)[:160]}", flush=True)


if __name__ == "__main__":
    main()
