"""Speculative decoding on the GPU path (Triton kernels, CUDA graphs for the steps without drafts): greedy tokens
equal transformers' in float32 while drafts are accepted and rejected. Needs CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from tests.fixtures.spec_models import echo_prone_model
from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_gpu_speculative_greedy_matches_transformers_in_float32(
        tiny_model: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory, enforce_eager: bool) -> None:
    model = echo_prone_model(tiny_model("llama"), tmp_path_factory.mktemp("spec-gpu") / "echo")
    rng = random.Random(0)
    heads = [[rng.randrange(3, 900) for _ in range(8)] for _ in range(4)]
    prompts = [head + walk + head for head, walk in zip(heads, hf_greedy(model, heads, 30), strict=True)]
    llm = LLM(model=str(model), dtype="float32", block_size=16, max_num_seqs=8, enforce_eager=enforce_eager,
              speculative_config=SPEC)
    assert not llm.engine.async_scheduling, "speculation runs synchronously"
    assert (llm.engine.runner.graphs is None) == enforce_eager
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == hf_greedy(model, prompts, 40)
    stats = llm.engine.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
