"""The fused MoE kernel equals its torch twin (engine/kernels/reference.py), which runs the experts one at a
time as transformers does: float32 and bf16, every expert here or only a slice of them (expert parallelism),
one expert per row (the rows an all-to-all delivers), and empty batches."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import reference
from engine.kernels.moe import MoeTiles, align_pairs, fused_moe

gpu = pytest.mark.gpu
# the interpreter's bf16 is truncation, and a pair's output rounds twice (activation, product) before the sum
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _problem(num_tokens: int, hidden: int, intermediate: int, num_experts: int, top_k: int, dtype: torch.dtype,
             device: str = "cpu") -> tuple[torch.Tensor, ...]:
    x = torch.randn(num_tokens, hidden, device=device).to(dtype)
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden, device=device) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, intermediate, device=device) / intermediate ** 0.5).to(dtype)
    probs = torch.randn(num_tokens, num_experts, device=device).softmax(dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return x, w13, w2, weights, ids


def _assert_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape
    tolerance = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_matches_reference(dtype: torch.dtype) -> None:
    # H and I not multiples of the tiles; 7 tokens x top-2 over 5 experts leave some experts empty or one row
    x, w13, w2, weights, ids = _problem(7, 40, 24, 5, 2, dtype)
    _assert_close(fused_moe(x, w13, w2, weights, ids), reference.fused_moe(x, w13, w2, weights, ids))


def test_fused_moe_with_a_slice_of_the_experts_skips_the_others() -> None:
    x, w13, w2, weights, ids = _problem(6, 32, 16, 6, 3, torch.float32)
    held = slice(2, 4)
    out = fused_moe(x, w13[held], w2[held], weights, ids, expert_start=2, num_experts=6)
    _assert_close(out, reference.fused_moe(x, w13[held], w2[held], weights, ids, expert_start=2))
    # the slices of all ranks add up to the whole layer
    whole = sum(fused_moe(x, w13[s:s + 2], w2[s:s + 2], weights, ids, expert_start=s, num_experts=6)
                for s in (0, 2, 4))
    _assert_close(whole, reference.fused_moe(x, w13, w2, weights, ids))


def test_fused_moe_one_expert_per_row_as_an_all_to_all_delivers() -> None:
    x, w13, w2, _, _ = _problem(5, 32, 16, 3, 1, torch.float32)
    ids = torch.tensor([[0], [0], [2], [2], [2]])
    ones = torch.ones(5, 1)
    _assert_close(fused_moe(x, w13, w2, ones, ids), reference.fused_moe(x, w13, w2, ones, ids))


def test_align_pairs_gives_every_block_one_expert_and_every_pair_one_slot() -> None:
    ids = torch.tensor([[3, 0], [0, 1], [3, 0], [5, 1]])  # expert 5 is another rank's
    aligned = align_pairs(ids, num_local_experts=4, expert_start=0, block_m=2)
    flat = ids.reshape(-1)
    slots = aligned.sorted_pair_ids.tolist()
    used = int(aligned.num_padded)
    # oracle by hand: expert 0 has 3 pairs (4 slots), 1 has 2, 2 none, 3 has 2; pair 6 (expert 5) is nowhere
    assert used == 8
    real = sorted(p for p in slots[:used] if p < flat.numel())
    assert real == [0, 1, 2, 3, 4, 5, 7]
    for block, expert in enumerate(aligned.block_expert_ids.tolist()[:used // 2]):
        assert all(int(flat[p]) == expert for p in slots[2 * block:2 * block + 2] if p < flat.numel())


def test_fused_moe_accepts_an_empty_batch() -> None:
    x, w13, w2, weights, ids = _problem(0, 32, 16, 4, 2, torch.float32)
    assert fused_moe(x, w13, w2, weights, ids).shape == (0, 32)


@gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 1000])
def test_fused_moe_on_gpu_qwen3_moe_shapes(num_tokens: int) -> None:
    x, w13, w2, weights, ids = _problem(num_tokens, 2048, 768, 128, 8, torch.bfloat16, "cuda")
    out = fused_moe(x, w13, w2, weights, ids)
    expected = reference.fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
    assert (out.float() - expected).norm() / expected.norm() < 1e-2
    tiles = MoeTiles(16, 32, 64, 4, 2)  # another tile shape gives the same result
    _assert_close(fused_moe(x, w13, w2, weights, ids, tiles=tiles), out)
