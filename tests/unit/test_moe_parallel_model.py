"""Mixture-of-experts models on two tensor-parallel ranks (gloo, float32): greedy tokens equal transformers'.
Two cases keep the suite's time in check (each starts a worker process): Qwen3-MoE with expert parallelism
dispatching tokens all-to-all, and Mixtral with every expert's intermediate dim split across the ranks; the MoE
block's other modes and architectures are checked against transformers' own block in tests/unit/test_moe_block.py."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy_cached

PROMPTS = [[17, 250, 3, 999, 42, 7], [600, 601, 602, 5, 88, 140], [901, 13, 13, 77, 402, 333]]


@pytest.mark.parametrize(("arch", "expert_parallel"), [("qwen3_moe", True), ("mixtral", False)])
def test_moe_model_on_two_ranks_matches_transformers(tiny_model: TinyModelFactory, arch: str,
                                                     expert_parallel: bool) -> None:
    model = tiny_model(arch)
    llm = LLM(model=str(model), dtype="float32", block_size=4, max_num_batched_tokens=8, tensor_parallel_size=2,
              enable_expert_parallel=expert_parallel,
              all2all_backend="all_to_all" if expert_parallel else "allgather_reducescatter")
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        assert out == hf_greedy_cached(model, PROMPTS, 8)
        parallel = llm.engine.runner.parallel
        assert parallel.expert_parallel == expert_parallel
        # expert parallelism all-to-all moves tokens between the ranks; TP-sharded experts never do
        assert ("all_to_all" in parallel.stats.by_kind) == expert_parallel
    finally:
        llm.close()
