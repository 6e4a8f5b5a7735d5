"""Writes a random-weight Llama model directory for benchmarks (no download): config + safetensors.

    python bench/make_model.py OUT_DIR [--hidden 768 --layers 12 --heads 12 --kv-heads 4 ...]

Both Tandem and the peer engine load the same directory, so their numbers compare the engines, not the models.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--max-positions", type=int, default=2048)
    args = parser.parse_args()

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate, vocab_size=args.vocab,
        max_position_embeddings=args.max_positions, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(args.out_dir, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out_dir} ({params / 1e6:.1f} M parameters)")


if __name__ == "__main__":
    main()
