"""Tensor and expert parallelism on two GPUs of one host (NCCL between the ranks, rank r on cuda:r): greedy tokens
of tiny random models on two ranks equal the same weights' tokens on one rank, and transformers' in float32.
Skipped where fewer than two CUDA devices exist (the CPU twins over gloo are tests/unit/test_tensor_parallel.py and
tests/unit/test_moe_parallel_model.py).

    python -m pytest -q -m multi_gpu tests/unit/test_multi_gpu.py tests/kvtransfer/test_ipc_gpu.py
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy, hf_greedy_cached

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def greedy_tokens(model: str, prompts: list[list[int]], **engine_args: object
                  ) -> tuple[list[list[int]], dict[str, int]]:
    """Greedy tokens of `prompts` on cuda and the collectives rank 0 took part in (by kind)."""
    llm = LLM(model=model, dtype="float32", device="cuda", block_size=16, **engine_args)  # type: ignore[arg-type]
    try:
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        return tokens, dict(llm.engine.runner.parallel.stats.by_kind)
    finally:
        llm.close()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_two_gpu_ranks_decode_the_same_greedy_tokens_as_one(tiny_model: TinyModelFactory,
                                                            async_scheduling: bool) -> None:
    # one KV head for two ranks (replicated) and biases added once: the cases a head split gets wrong
    model = str(tiny_model("llama", num_key_value_heads=1, attention_bias=True, mlp_bias=True))
    rng = random.Random(0)
    # a one-token prompt, one of several blocks, and one prefilled in two chunks (max_num_batched_tokens)
    prompts = [[rng.randrange(3, 900) for _ in range(n)] for n in (1, 20, 40)]
    one, _ = greedy_tokens(model, prompts, tensor_parallel_size=1)
    two, collectives = greedy_tokens(model, prompts, tensor_parallel_size=2, max_num_batched_tokens=32,
                                     async_scheduling=async_scheduling)
    assert two == one
    assert one == hf_greedy(model, prompts, GREEDY.max_tokens)  # the oracle: neither run checks only the other
    assert collectives["all_reduce"] > 0
    # asynchronous scheduling feeds the ranks the last step's samples over NCCL
    assert (collectives.get("broadcast", 0) > 0) == async_scheduling


@pytest.mark.parametrize("all2all_backend", ["allgather_reducescatter", "all_to_all"])
def test_qwen3_moe_on_two_gpus_with_expert_parallelism_matches_one_gpu(tiny_model: TinyModelFactory,
                                                                       all2all_backend: str) -> None:
    model = str(tiny_model("qwen3_moe"))
    prompts = [[17, 250, 3, 999, 42, 7], [600, 601, 602, 5, 88, 140], [901, 13, 13, 77, 402, 333]]
    one, _ = greedy_tokens(model, prompts, tensor_parallel_size=1)
    expert_parallel, collectives = greedy_tokens(model, prompts, tensor_parallel_size=2,
                                                 enable_expert_parallel=True, all2all_backend=all2all_backend)
    tensor_parallel, _ = greedy_tokens(model, prompts, tensor_parallel_size=2)
    assert expert_parallel == one
    assert tensor_parallel == one
    assert one == hf_greedy_cached(model, prompts, GREEDY.max_tokens)
    assert ("all_to_all" in collectives) == (all2all_backend == "all_to_all")
