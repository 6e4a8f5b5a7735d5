"""N-gram speculative decoding vs none: output tokens/s at batch 1 on a code-editing prompt (a code file, then the
start of its copy with one small change: most of the answer is in the prompt).

    python3 bench/spec_decode.py [--real-model /tmp/smollm2-hf] [--output-len 256] [--out FILE]

Two models, each with speculation off and on (`{"method": "ngram", "num_speculative_tokens": K,
"prompt_lookup_max": N, "prompt_lookup_min": M}`), each run in a fresh process (one engine on the GPU at a time):

- Llama-3.1-8B's shape with dummy bf16 weights (bench/models/llama8b-shape): the cost side. Random weights do not
  copy the prompt, so nearly every draft is rejected: this measures what verification costs (a k+1-token query
  run eagerly instead of the decode CUDA graph) when it buys nothing.
- a real model, `--real-model` (default /tmp/smollm2-hf, SmolLM2-135M-Instruct as bench/gguf_to_hf.py writes it;
  skipped when absent): the gain side, with a real acceptance rate.

Greedy, ignore_eos, `--output-len` tokens. Reported per run: prefill seconds (a max_tokens=1 run), end-to-end
seconds, decode tokens/s ((output_len - 1) / (e2e - prefill)), the spec-decode counters (drafts, draft tokens,
accepted) and whether the speculative output equals the plain one token for token (bf16: a near-tie may flip).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LLAMA8B_SHAPE_DIR = ROOT / "bench" / "models" / "llama8b-shape"
CODE_FILE = ROOT / "engine" / "cache" / "kv_cache_manager.py"  # ~1.1k tokens of real Python
# A completion prompt, not a chat turn: a 135M instruct model asked in chat to repeat a file summarises it instead
# (measured: SmolLM2-135M-Instruct), while a file followed by the start of its edited copy is continued as a copy,
# as a code-editing assistant's answer mostly is.
EDIT_PROMPT = ("# {name}\n```python\n{code}```\n\n# {name}, with the method `blocks_needed` renamed to "
               "`num_blocks_needed`\n```python\n")


def code_editing_prompt(tokenizer: Any) -> list[int]:
    return list(tokenizer.encode(EDIT_PROMPT.format(name=CODE_FILE.name, code=CODE_FILE.read_text())))


def run_one(model: str, load_format: str, spec: dict[str, Any] | None, output_len: int) -> dict[str, Any]:
    """One engine in this process: warm-up, a prefill-only run, then the timed generation."""
    import torch

    from engine import LLM, SamplingParams

    llm = LLM(model=model, dtype="bfloat16", load_format=load_format, max_model_len=8192, max_num_seqs=8,
              speculative_config=spec)
    prompt = code_editing_prompt(llm.get_tokenizer())
    llm.generate([prompt[:64]], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))  # warm-up

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def timed(max_tokens: int) -> tuple[float, list[int]]:
        sync()
        start = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        sync()
        return time.perf_counter() - start, out[0].outputs[0].token_ids

    before = llm.engine.stats()
    prefill_s = min(timed(1)[0] for _ in range(3))
    e2e_s, token_ids = timed(output_len)
    after = llm.engine.stats()
    drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    draft_tokens = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    return {"model": model, "load_format": load_format, "speculative_config": spec, "prompt_tokens": len(prompt),
            "output_tokens": len(token_ids), "prefill_s": prefill_s, "e2e_s": e2e_s,
            "e2e_tokens_per_s": len(token_ids) / e2e_s,
            "decode_tokens_per_s": (len(token_ids) - 1) / max(e2e_s - prefill_s, 1e-9),
            "num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "mean_tokens_per_verification": 1 + accepted / drafts if drafts else None,
            "token_ids": token_ids, "text": llm.get_tokenizer().decode(token_ids)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real-model", default="/tmp/smollm2-hf", help="a real model directory (skipped if absent)")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--skip-shape-model", action="store_true",
                        help="only the real model (e.g. on a CPU, for its acceptance rate)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: one run, JSON on stdout
    args = parser.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}
    if args.one is not None:
        job = json.loads(args.one)
        result = run_one(job["model"], job["load_format"], job["spec"], args.output_len)
        print("RESULT " + json.dumps(result), flush=True)
        return

    models = [] if args.skip_shape_model else [(str(LLAMA8B_SHAPE_DIR), "dummy")]
    if Path(args.real_model).exists():
        models.append((args.real_model, "auto"))
    else:
        print(f"{args.real_model} is absent: the real-model runs are skipped", flush=True)
    results = []
    for model, load_format in models:
        pair = []
        for job_spec in (None, spec):
            job = json.dumps({"model": model, "load_format": load_format, "spec": job_spec})
            proc = subprocess.run([sys.executable, __file__, "--one", job, "--output-len", str(args.output_len)],
                                  capture_output=True, text=True, check=False)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"run {job} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
            pair.append(json.loads(line.removeprefix("RESULT ")))
        off, on = pair
        same = next((i for i, (a, b) in enumerate(zip(off["token_ids"], on["token_ids"], strict=True)) if a != b),
                    len(off["token_ids"]))
        summary = {"model": model, "prompt_tokens": off["prompt_tokens"], "output_tokens": off["output_tokens"],
                   "decode_tokens_per_s_off": off["decode_tokens_per_s"],
                   "decode_tokens_per_s_on": on["decode_tokens_per_s"],
                   "speedup_decode": on["decode_tokens_per_s"] / off["decode_tokens_per_s"],
                   "e2e_tokens_per_s_off": off["e2e_tokens_per_s"], "e2e_tokens_per_s_on": on["e2e_tokens_per_s"],
                   "acceptance_rate": on["acceptance_rate"],
                   "mean_tokens_per_verification": on["mean_tokens_per_verification"],
                   "identical_leading_tokens": same}
        print(json.dumps(summary, indent=1), flush=True)
        if load_format == "auto":
            print("text (speculative):", json.dumps(on["text"][:600]), flush=True)
        results.append({"summary": summary, "off": off, "on": on})
    if args.out is not None:
        args.out.write_text(json.dumps({"spec": spec, "output_len": args.output_len, "results": results}, indent=1))


if __name__ == "__main__":
    main()
