"""Where a prefill step's GPU time goes in the offline workload: 8 fresh 1024-token prompts (one 8192-token step)
alone, and joined to a running decode batch (Llama-3.1-8B shape, dummy bf16).

    python3 bench/h200/mixed_profile.py [--decodes 128]

Prints, for each case, the step's wall time (synchronous, eager: as the engine runs a step with prompt tokens),
its sum of kernel times, the matmul-rate floor of its FLOPs, and the top kernels.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_gpu import matmul_rate  # noqa: E402
from step_profile import kernel_totals  # noqa: E402

from bench.tp_step import LLAMA_31_8B  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--decodes", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1024)
    args = parser.parse_args()
    from engine import LLM, SamplingParams

    flops = matmul_rate()
    config_dir = Path(tempfile.mkdtemp())
    (config_dir / "config.json").write_text(json.dumps(LLAMA_31_8B))
    llm = LLM(model=str(config_dir), dtype="bfloat16", load_format="dummy", max_num_seqs=256,
              max_num_batched_tokens=args.prompts * args.prompt_len, max_model_len=2 * args.prompt_len + 64,
              skip_tokenizer_init=True, async_scheduling=False)
    engine = llm.engine
    model = engine.runner.model
    num_params = sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel()
    params = SamplingParams(temperature=0.0, max_tokens=600, ignore_eos=True)
    counter = iter(range(10 ** 6))

    def add_prompts(n: int) -> list[str]:
        ids = []
        for _ in range(n):
            i = next(counter)
            rid = f"r{i}"
            engine.add_request(rid, [(7 * i + j) % 50_000 + 10 for j in range(args.prompt_len)], params)
            ids.append(rid)
        return ids

    for label, num_decodes in (("prefill alone", 0), (f"prefill + {args.decodes} decodes", args.decodes)):
        running = add_prompts(num_decodes)
        while any(engine.requests[r].num_output_tokens == 0 for r in running):
            engine.step()
        for _ in range(2):
            engine.step()
        add_prompts(args.prompts)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        totals, counts = kernel_totals(prof)
        total = sum(totals.values())
        tokens = args.prompts * args.prompt_len + num_decodes
        floor = 2 * num_params * tokens / flops
        print(f"\n## {label}: wall {wall * 1e3:.1f} ms (profiled), kernels {total / 1e3:.1f} ms, "
              f"matmul floor {floor * 1e3:.1f} ms ({flops / 1e12:.0f} TFLOP/s)")
        print("| ms | % | launches | kernel |\n|---|---|---|---|")
        for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:30]:
            print(f"| {us / 1e3:.2f} | {100 * us / total:.1f} | {counts[name]} | {name[:110]} |")
        add_prompts(args.prompts)  # the same step again, unprofiled
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        print(f"unprofiled wall: {(time.perf_counter() - start) * 1e3:.1f} ms")
        for rid in list(engine.requests):
            engine.abort(rid)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
