"""The naive baseline: Hugging Face transformers' `generate` on a model directory's config with random weights.

    python bench/hf_generate.py MODEL_DIR [--device cuda] [--dtype bfloat16] [--batch-sizes 1,16]
        [--input-len 1024] [--output-len 256] [--json OUT.json]

Greedy, every sequence forced to exactly --output-len new tokens; one untimed warm-up call per batch size.
Prints one line per batch size and, with --json, writes them as a list of records.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(model: Any, batch_size: int, input_len: int, output_len: int, vocab_size: int, device: torch.device,
        seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed + batch_size)
    input_ids = torch.randint(10, vocab_size, (batch_size, input_len), generator=generator).to(device)
    attention_mask = torch.ones_like(input_ids)

    def generate(new_tokens: int) -> torch.Tensor:
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)

    generate(2)  # warm-up: kernels, allocator
    synchronize(device)
    start = time.perf_counter()
    out = generate(output_len)
    synchronize(device)
    seconds = time.perf_counter() - start
    num_output = int(out.shape[0] * (out.shape[1] - input_len))
    return {"engine": "transformers generate", "batch_size": batch_size, "input_len": input_len,
            "output_len": output_len, "seconds": seconds, "output_tokens": num_output,
            "output_throughput": num_output / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    config = AutoConfig.from_pretrained(args.model, local_files_only=True)
    start = time.perf_counter()
    with torch.device(device):  # drawn on the device: an 8B model initialized on the host takes minutes
        model = AutoModelForCausalLM.from_config(config, dtype=_DTYPES[args.dtype])
    model.eval()
    synchronize(device)
    print(f"transformers {type(model).__name__}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B "
          f"parameters on {device} in {args.dtype}, built in {time.perf_counter() - start:.1f} s", flush=True)
    records = []
    with torch.inference_mode():
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            record = run(model, batch_size, args.input_len, args.output_len, config.vocab_size, device, args.seed)
            records.append(record)
            print(f"batch {batch_size}: {record['output_tokens']} tokens in {record['seconds']:.2f} s = "
                  f"{record['output_throughput']:.1f} output tok/s", flush=True)
    if args.json:
        args.json.write_text(json.dumps(records, indent=2) + "\n")


if __name__ == "__main__":
    main()
