"""A/B of the engine's CPU decode step in one process, A and B alternating (this box's speed drifts by a third
from minute to minute, so only side-by-side ratios mean anything):

    python bench/cpu_decode_ab.py --model DIR_OR_GGUF [--dtype float32] [--batch 8] [--rounds 6] \
        --ab linear|waker|team|attention|ops

  linear  the model's linear layers as loaded (torch's F.linear) vs packed for oneDNN (engine/layers/cpu_linear.py),
          two engines stepping in turn;
  waker   the step alone vs next to a process that wakes every 2 ms and spins 50 us (what an idle node's engine
          thread used to do): how much a neighbour's wake-ups cost a step whose OpenMP threads fill the cores;
  team    the step alone vs while another thread of the process holds an idle OpenMP team (what a node's main
          thread held when it had loaded the engine: node_common/options.py);
  attention  decode attention as a gather of the context + SDPA vs the in-place C++ kernel
          (engine/layers/cpu_paged_attention.py);
  ops     a layer's small ops (RMSNorm + residual add, RoPE + K/V store, SiLU-and-mul) as torch ops vs one C++ pass
          each (engine/layers/cpu_layer_ops.cpp).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
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


def _hold_a_team(release: threading.Event) -> None:
    import torch

    torch.ones(1 << 22).sum()  # a parallel region: this thread now has an OpenMP team
    release.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4, help="steps per side per round")
    parser.add_argument("--ab", choices=["linear", "waker", "team", "attention", "ops"], required=True)
    args = parser.parse_args()

    import engine.model.loader as loader
    from engine import LLM, SamplingParams
    from engine.layers import cpu_kernels, cpu_paged_attention
    from engine.llm_engine import LLMEngine

    def decoding_engine() -> LLMEngine:
        engine = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.batch, max_num_batched_tokens=4096,
                     skip_tokenizer_init=True).engine
        params = SamplingParams(temperature=0.0, max_tokens=2 * args.rounds * args.steps + 8, ignore_eos=True)
        ids = [f"r{i}" for i in range(args.batch)]
        for i, request_id in enumerate(ids):
            engine.add_request(request_id, [(7 * i + j) % 1000 + 10 for j in range(args.context)], params)
        while any(engine.requests[r].num_output_tokens == 0 for r in ids):
            engine.step()
        return engine

    def timed_steps(engine: LLMEngine) -> list[float]:
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        return times

    engine = decoding_engine()
    if args.ab == "linear":
        pack = loader.pack_cpu_linears
        loader.pack_cpu_linears = lambda model: 0  # type: ignore[assignment]  # the unpacked side
        unpacked = decoding_engine()
        loader.pack_cpu_linears = pack
    sides: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        if args.ab == "linear":
            sides.setdefault("F.linear (unpacked)", []).extend(timed_steps(unpacked))
            sides.setdefault("packed for oneDNN", []).extend(timed_steps(engine))
        elif args.ab == "attention":
            serves = cpu_paged_attention.serves
            cpu_paged_attention.serves = lambda *_: False  # type: ignore[assignment]
            sides.setdefault("gather + SDPA", []).extend(timed_steps(engine))
            cpu_paged_attention.serves = serves
            sides.setdefault("in-place kernel", []).extend(timed_steps(engine))
        elif args.ab == "ops":
            layer_ops_serve = cpu_kernels.layer_ops_serve
            cpu_kernels.layer_ops_serve = lambda *_, **__: False  # type: ignore[assignment]
            sides.setdefault("torch ops", []).extend(timed_steps(engine))
            cpu_kernels.layer_ops_serve = layer_ops_serve
            sides.setdefault("C++ layer ops", []).extend(timed_steps(engine))
        elif args.ab == "team":
            sides.setdefault("alone", []).extend(timed_steps(engine))
            release = threading.Event()
            holder = threading.Thread(target=_hold_a_team, args=(release,))
            holder.start()
            time.sleep(0.2)
            sides.setdefault("beside another thread's idle OpenMP team", []).extend(timed_steps(engine))
            release.set()
            holder.join()  # the team ends with its thread
        else:
            sides.setdefault("alone", []).extend(timed_steps(engine))
            waker = subprocess.Popen([sys.executable, "-c", WAKER])
            time.sleep(0.2)
            sides.setdefault("next to a 500 Hz waker", []).extend(timed_steps(engine))
            waker.kill()
            waker.wait()
    print(f"decode step, {args.dtype}, batch {args.batch}, context {args.context}, {args.rounds} rounds alternating:")
    for side, times in sides.items():
        print(f"  {side}: median {statistics.median(times) * 1e3:.1f} ms, min {min(times) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
