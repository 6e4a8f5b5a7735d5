"""The fixed offline workload shared by Tandem's and the peer's benchmark scripts (plain Python, no torch)."""

from __future__ import annotations

import random

NUM_PROMPTS = 64
PROMPT_LEN = 256
OUTPUT_LEN = 128


def prompts(vocab_size: int, num_prompts: int = NUM_PROMPTS, prompt_len: int = PROMPT_LEN,
            seed: int = 0) -> list[list[int]]:
    """Random token ids, skipping the first few ids (special tokens in most vocabularies)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab_size) for _ in range(prompt_len)] for _ in range(num_prompts)]
