"""The sparse MoE block equals transformers' own block (float32) for Qwen2-MoE, Qwen3-MoE and Mixtral: on one
rank, and split over 2 gloo ranks every way (TP-sharded experts; expert parallel with either token exchange:
one all-reduce over replicated tokens, or all-to-all dispatch and combine).

The oracle blocks are transformers' modules with random weights; ours load those weights through the same
path a checkpoint takes (transformers 5's stacked expert tensors), each rank keeping only its part.
"""

from __future__ import annotations

import functools
import socket
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from engine.config import ModelConfigError, MoeConfig
from engine.layers.moe import SparseMoeBlock
from engine.parallel.context import SINGLE_RANK, ParallelContext
from tests.fixtures.moe_ranks import HIDDEN, MODES, NUM_RANKS, TOKEN_COUNTS, engine_block, inputs, rank_main

# transformers' block and config arguments, the same sizes as tests/fixtures/moe_ranks.py's MOE_CONFIGS
ORACLES: dict[str, tuple[type[torch.nn.Module], dict[str, Any]]] = {
    "qwen2_moe": (Qwen2MoeSparseMoeBlock, {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 16,
                                           "shared_expert_intermediate_size": 24, "norm_topk_prob": False}),
    "qwen3_moe": (Qwen3MoeSparseMoeBlock, {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                           "norm_topk_prob": True}),
    "mixtral": (MixtralSparseMoeBlock, {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 24}),
}
RankOutputs = list[dict[tuple[str, str, int], torch.Tensor]]


@functools.cache
def _oracle_block(arch: str) -> torch.nn.Module:
    block_cls, moe_args = ORACLES[arch]
    block = block_cls(AutoConfig.for_model(arch, hidden_size=HIDDEN, **moe_args))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in block.parameters():  # the experts start uninitialised (torch.empty)
            param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    return block.eval()


def _oracle_state(arch: str) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in _oracle_block(arch).state_dict().items()}


def _expected(arch: str, num_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return _oracle_block(arch)(inputs(num_tokens)[None])[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def rank_outputs(tmp_path_factory: pytest.TempPathFactory) -> RankOutputs:
    work_dir = tmp_path_factory.mktemp("moe_ranks")
    torch.save({arch: _oracle_state(arch) for arch in ORACLES}, work_dir / "states.pt")
    mp.start_processes(rank_main, args=(_free_port(), work_dir), nprocs=NUM_RANKS, start_method="spawn", join=True)
    return [torch.load(work_dir / f"rank{rank}.pt") for rank in range(NUM_RANKS)]


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("arch", list(ORACLES))
def test_single_rank_block_matches_transformers(arch: str, fused: bool) -> None:
    # triton: the fused MoE and SiLU-and-mul kernels, interpreted (TRITON_INTERPRET=1, tests/conftest.py)
    block = engine_block(arch, _oracle_state(arch), SINGLE_RANK, fused)
    for num_tokens in TOKEN_COUNTS:
        with torch.no_grad():
            torch.testing.assert_close(block(inputs(num_tokens)), _expected(arch, num_tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", list(ORACLES))
def test_block_split_over_two_gloo_ranks_matches_transformers_on_every_rank(arch: str, mode: str,
                                                                            rank_outputs: RankOutputs) -> None:
    for num_tokens in TOKEN_COUNTS:
        expected = _expected(arch, num_tokens)
        for outputs in rank_outputs:
            torch.testing.assert_close(outputs[arch, mode, num_tokens], expected, rtol=1e-5, atol=1e-5)


def test_an_expert_count_that_does_not_split_over_the_ranks_is_refused() -> None:
    moe = MoeConfig(num_experts=3, num_experts_per_tok=1, intermediate_size=16, norm_topk_prob=True)
    two_ranks = ParallelContext(tp_rank=0, tp_size=2, expert_parallel=True, group=object())
    with pytest.raises(ModelConfigError, match="multiple of the ranks"):
        SparseMoeBlock(HIDDEN, moe, round_weights=True, parallel=two_ranks)
