"""The dense attention of a prompt step's fresh prompts: one cuDNN SDPA call per prompt over padded copies (the
engine before) against one call for the whole run of equal-length prompts over views of the fused qkv projection.

    python3 bench/h200/dense_batch_probe.py [--prompts 8] [--lengths 1024,2048]

Llama-3.1-8B attention shape (32 q / 8 kv heads, D 128, bf16). Per case: the device time of 32 layers' worth of
calls (events; the host launching as the engine does), the first call's time at that shape (the cuDNN plan),
whether the batched result equals the per-prompt one, and whether its output is a view back to [tokens, heads, D].
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import sdpa_kernel  # noqa: E402

from engine.kernels.backend import _DENSE_BACKENDS, dense_causal_attention, dense_length  # noqa: E402

HQ, HKV, D = 32, 8, 128


def padded_copies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The engine's dense attention before: every prompt alone, over padded copies of q, k and v."""
    num_tokens = q.shape[0]
    padding = (0, 0, 0, 0, 0, dense_length(num_tokens) - num_tokens)
    q, k, v = (F.pad(x, padding) for x in (q, k, v))
    with sdpa_kernel(_DENSE_BACKENDS, set_priority=True):
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], is_causal=True, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)[:num_tokens]


def timed(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def run_case(length: int, prompts: int, scale: float) -> None:
    n = max(1, prompts * 1024 // length)
    tokens = n * length
    qkv = torch.randn(32, tokens, (HQ + 2 * HKV) * D, dtype=torch.bfloat16, device="cuda")  # 32 layers
    views = [x.split([HQ * D, HKV * D, HKV * D], dim=-1) for x in qkv]
    # as in the engine: q and k fresh from the rotary kernel (contiguous), v a view of the projection
    views = [(q.reshape(tokens, HQ, D).clone(), k.reshape(tokens, HKV, D).clone(), v.view(tokens, HKV, D))
             for q, k, v in views]
    out = torch.empty(tokens, HQ, D, dtype=torch.bfloat16, device="cuda")

    def per_prompt(fn) -> None:
        for q, k, v in views:
            for b in range(n):
                rows = slice(b * length, (b + 1) * length)
                out[rows] = fn(q[rows], k[rows], v[rows], scale)

    def batched(copy_out: bool) -> None:
        for q, k, v in views:
            result = dense_causal_attention(q, k, v, scale, n)
            if copy_out:
                out.copy_(result)

    torch.cuda.synchronize()
    start = time.perf_counter()
    first = dense_causal_attention(*views[0], scale, n)
    torch.cuda.synchronize()
    plan_ms = (time.perf_counter() - start) * 1e3
    reference = torch.empty_like(out)
    q, k, v = views[0]
    for b in range(n):
        rows = slice(b * length, (b + 1) * length)
        reference[rows] = padded_copies(q[rows], k[rows], v[rows], scale)
    equal = torch.equal(first, reference)
    max_diff = (first.float() - reference.float()).abs().max().item()
    is_view = first.is_contiguous()
    flops = 32 * n * 2 * length * length * HQ * D  # causal: half of 4 T^2 H D, 32 layers
    t_prompt = timed(lambda: per_prompt(padded_copies))
    t_prompt_new = timed(lambda: per_prompt(dense_causal_attention))
    t_batch = timed(lambda: batched(False))
    t_batch_copy = timed(lambda: batched(True))
    print(f"{n} x {length}: per-prompt {t_prompt:.2f} ms ({flops / t_prompt / 1e9:.0f} TFLOP/s), per-prompt "
          f"without the q/k copies {t_prompt_new:.2f} ms, batched "
          f"{t_batch:.2f} ms ({flops / t_batch / 1e9:.0f}), batched + copy into the step's output "
          f"{t_batch_copy:.2f} ms; first batched call {plan_ms:.1f} ms; equal {equal} (max diff {max_diff:.1e}); "
          f"output contiguous as [tokens, heads, D]: {is_view}")



def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--lengths", default="1024,2048")
    args = parser.parse_args()
    scale = D ** -0.5
    x = torch.randn(256, HQ, D, dtype=torch.bfloat16, device="cuda")
    dense_causal_attention(x, x[:, :HKV], x[:, :HKV], scale)  # the process's first cuDNN call, off the books
    for length in (int(x) for x in args.lengths.split(",")):
        run_case(length, args.prompts, scale)

if __name__ == "__main__":
    main()
