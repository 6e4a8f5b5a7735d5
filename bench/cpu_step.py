"""One engine step on CPU, timed and profiled: a decode step at batch 64 and a 256-token prefill.

    python bench/cpu_step.py --model DIR [--dtype bfloat16] [--batch 64] [--context 256] [--steps 8] [--profile]

The decode step is timed through the engine (scheduler, runner, sampler), and the model's forward alone on the
same batch, so the host's share shows. --profile prints torch.profiler's table of both, by operator.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    from engine import LLM, SamplingParams
    from engine.scheduler import SchedulerOutput

    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.batch, max_num_batched_tokens=4096,
              skip_tokenizer_init=True)
    engine = llm.engine
    runner = engine.runner
    params = SamplingParams(temperature=0.0, max_tokens=10 * args.steps + 10, ignore_eos=True)
    ids = [f"r{i}" for i in range(args.batch)]
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, [(7 * i + j) % 1000 + 10 for j in range(args.context)], params)

    # the prefill steps: the first is timed as "a prefill of max_num_batched_tokens / context prompts"
    start = time.perf_counter()
    engine.step()
    prefill_s = time.perf_counter() - start
    while any(engine.requests[r].num_output_tokens == 0 for r in ids):
        engine.step()
    for _ in range(2):
        engine.step()

    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_s = (time.perf_counter() - start) / args.steps

    # the model's forward alone, on the batch the scheduler would make next
    captured: list[SchedulerOutput] = []
    execute = runner.execute

    def capture(out: SchedulerOutput):  # type: ignore[no-untyped-def]
        captured.append(out)
        return execute(out)

    runner.execute = capture  # type: ignore[method-assign]
    engine.step()
    runner.execute = execute  # type: ignore[method-assign]
    items = sorted(captured[0].scheduled, key=lambda s: s.num_new_tokens != 1)
    with torch.inference_mode():
        input_ids, positions, meta, _ = runner._device_inputs(runner._host_inputs(items))
        start = time.perf_counter()
        for _ in range(args.steps):
            hidden = runner.model(input_ids, positions, runner.kv_caches, meta, runner.backend)
            runner.model.compute_logits(hidden)
        forward_s = (time.perf_counter() - start) / args.steps
    prompts_per_prefill = min(args.batch, 4096 // args.context)
    print(f"prefill step ({prompts_per_prefill} x {args.context} tokens): {prefill_s * 1e3:8.1f} ms")
    print(f"decode step (batch {args.batch}): {step_s * 1e3:8.1f} ms engine, {forward_s * 1e3:8.1f} ms forward"
          f" + logits ({args.batch / step_s:.1f} tok/s)")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                hidden = runner.model(input_ids, positions, runner.kv_caches, meta, runner.backend)
                runner.model.compute_logits(hidden)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    for request_id in ids:
        engine.abort(request_id)


if __name__ == "__main__":
    main()
