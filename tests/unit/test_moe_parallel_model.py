"""Mixture-of-experts models on two tensor-parallel ranks (gloo, float32): greedy tokens equal transformers', for
each architecture with its experts TP-sharded (every expert's intermediate dim split) and expert-parallel (whole
experts per rank; the two token exchanges alternate over the architectures). The MoE block's every mode and
architecture is also checked against transformers' own block in tests/unit/test_moe_block.py."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy_cached

PROMPTS = [[17, 250, 3, 999, 42, 7], [600, 601, 602, 5, 88, 140], [901, 13, 13, 77, 402, 333]]


@pytest.mark.parametrize(("arch", "expert_parallel", "all2all_backend"), [
    ("qwen2_moe", False, "allgather_reducescatter"), ("qwen2_moe", True, "allgather_reducescatter"),
    ("qwen3_moe", False, "allgather_reducescatter"), ("qwen3_moe", True, "all_to_all"),
    ("mixtral", False, "allgather_reducescatter"), ("mixtral", True, "all_to_all"),
])
def test_moe_model_on_two_ranks_matches_transformers(tiny_model: TinyModelFactory, arch: str, expert_parallel: bool,
                                                     all2all_backend: str) -> None:
    model = tiny_model(arch)
    llm = LLM(model=str(model), dtype="float32", block_size=4, max_num_batched_tokens=8, tensor_parallel_size=2,
              enable_expert_parallel=expert_parallel, all2all_backend=all2all_backend)
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        assert out == hf_greedy_cached(model, PROMPTS, 8)
        parallel = llm.engine.runner.parallel
        assert parallel.expert_parallel == expert_parallel
        # only expert parallelism's all-to-all exchange moves tokens between the ranks
        assert ("all_to_all" in parallel.stats.by_kind) == (expert_parallel and all2all_backend == "all_to_all")
    finally:
        llm.close()
