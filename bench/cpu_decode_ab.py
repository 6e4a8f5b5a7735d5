"""A/B of the engine's CPU decode step in one process, A and B alternating (this box's speed drifts by a third
from minute to minute, so only side-by-side ratios mean anything):

    python bench/cpu_decode_ab.py --model DIR_OR_GGUF [--dtype float32] [--batch 8] [--rounds 6] --ab linear|waker

  linear  the few-rows product of engine/layers/linear.py off (CPU_FEW_ROWS = 0) vs on;
  waker   the step alone vs next to a process that wakes every 2 ms and spins 50 us (what an idle node's engine
          thread used to do): how much a neighbour's wake-ups cost a step whose OpenMP threads fill the cores.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WAKER = """
import time
while True:
    time.sleep(0.002)
    start = time.perf_counter()
    while time.perf_counter() - start < 50e-6:
        pass
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4, help="steps per side per round")
    parser.add_argument("--ab", choices=["linear", "waker"], required=True)
    args = parser.parse_args()

    import engine.layers.linear as linear
    from engine import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.batch, max_num_batched_tokens=4096,
              skip_tokenizer_init=True)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=2 * args.rounds * args.steps + 8, ignore_eos=True)
    ids = [f"r{i}" for i in range(args.batch)]
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, [(7 * i + j) % 1000 + 10 for j in range(args.context)], params)
    while any(engine.requests[r].num_output_tokens == 0 for r in ids):
        engine.step()

    def timed_steps() -> list[float]:
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        return times

    sides: dict[str, list[float]] = {}
    few_rows = linear.CPU_FEW_ROWS
    for _ in range(args.rounds):
        if args.ab == "linear":
            linear.CPU_FEW_ROWS = 0
            sides.setdefault("x @ W^T (few-rows product off)", []).extend(timed_steps())
            linear.CPU_FEW_ROWS = few_rows
            sides.setdefault(f"(W @ x^T)^T up to {few_rows} rows", []).extend(timed_steps())
        else:
            sides.setdefault("alone", []).extend(timed_steps())
            waker = subprocess.Popen([sys.executable, "-c", WAKER])
            time.sleep(0.2)
            sides.setdefault("next to a 500 Hz waker", []).extend(timed_steps())
            waker.kill()
            waker.wait()
    print(f"decode step, {args.dtype}, batch {args.batch}, context {args.context}, {args.rounds} rounds alternating:")
    for side, times in sides.items():
        print(f"  {side}: median {statistics.median(times) * 1e3:.1f} ms, min {min(times) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
