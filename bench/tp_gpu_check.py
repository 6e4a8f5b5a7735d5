"""Tensor parallelism on GPUs (NCCL): greedy tokens of tiny random models (Llama with a replicated KV head and
biases, Qwen2, Qwen3) with TP=1 and TP=2 against transformers in float32 (TP=2 runs eager, with asynchronous
scheduling: the input ids are broadcast over NCCL).

    python bench/tp_gpu_check.py [--out DIR]      # needs 2 GPUs; torch 2.11 / python 3.12, no internet
    python bench/tp_gpu_check.py --shape llama-3.1-8b [--num-layers 4] [--dtype float32] [--max-tokens 16]

--shape NAME (bench/tp_step.py's shapes): instead, one random checkpoint of that shape (transformers' own init,
std 0.02, drawn on the device and saved as safetensors, so both runs load the very same weights: the engine's
dummy weights differ per rank), and the TP=2 node's greedy tokens against the TP=1 engine's for a few prompts
(1 to 700 tokens), with the first position where they part if they do. The layers are what TP splits; --num-layers
keeps the checkpoint small (the default, 4 layers of Llama-3.1-8B in float32, is about 8 GB).

Prints one JSON line per check; exits 1 when a token differs.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.tp_step import SHAPES, shape_config  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from tests.fixtures.tiny_models import build_tiny_model, hf_greedy  # noqa: E402


def tiny_checks(root: Path, device: str) -> bool:
    ok = True
    for arch, overrides in (("llama", {"num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True}),
                            ("qwen2", {}), ("qwen3", {})):
        model = build_tiny_model(arch, root / arch, **overrides)
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 900) for _ in range(n)] for n in (1, 9, 30)]
        expected = hf_greedy(model, prompts, 8)
        for tp in (1, 2):
            got = greedy(model, prompts, 8, device, tp, "float32")
            ok &= got == expected
            print(json.dumps({"arch": arch, "tp": tp, "token_exact": got == expected}), flush=True)
    return ok


def greedy(model: Path, prompts: list[list[int]], max_tokens: int, device: str, tp: int, dtype: str
           ) -> list[list[int]]:
    llm = LLM(model=str(model), dtype=dtype, device=device, tensor_parallel_size=tp, block_size=16,
              skip_tokenizer_init=not (model / "tokenizer.json").is_file(), max_model_len=1024)
    try:
        return [o.outputs[0].token_ids for o in
                llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))]
    finally:
        llm.close()


def write_checkpoint(shape: str, num_layers: int | None, out: Path, device: str, dtype: str) -> Path:
    """A random checkpoint of `shape` (transformers' init, seed 0) in `out`, as safetensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**shape_config(shape, num_layers), "dtype": dtype}))
    config = AutoConfig.from_pretrained(out)
    torch.manual_seed(0)
    with torch.device("cuda" if device == "cuda" else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(out)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def shape_check(args: argparse.Namespace, root: Path) -> bool:
    model = write_checkpoint(args.shape, args.num_layers, root / args.shape, args.device, args.dtype)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab) for _ in range(n)] for n in (1, 37, 700)]
    one = greedy(model, prompts, args.max_tokens, args.device, 1, args.dtype)
    two = greedy(model, prompts, args.max_tokens, args.device, 2, args.dtype)
    for prompt, a, b in zip(prompts, one, two, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        print(json.dumps({"shape": args.shape, "layers": args.num_layers, "dtype": args.dtype,
                          "prompt_tokens": len(prompt), "tp1_tokens": a, "tp2_tokens": b, "token_exact": a == b,
                          "first_difference": first, "distinct_tokens": len(set(a))}), flush=True)
    return one == two


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device", default="cuda", help="cpu runs the same checks over gloo")
    parser.add_argument("--shape", default=None, choices=sorted(SHAPES),
                        help="TP=2 against TP=1 on a random checkpoint of this shape (instead of the tiny checks)")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="tp-gpu-"))
    ok = shape_check(args, root) if args.shape else tiny_checks(root, args.device)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
