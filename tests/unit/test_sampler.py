from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from engine.sampler import Sampler, SamplingRow, noise_seed, process_logits, uniform_of
from engine.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def make_row(
    params: SamplingParams = GREEDY,
    *,
    seed: int = 0,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    eos: Sequence[int] = (),
) -> SamplingRow:
    return SamplingRow(params, None if params.greedy else seed, list(prompt), list(output), frozenset(eos))


def sample_ids(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
    return [token.token_id for token in Sampler()(logits, rows)]


def test_greedy_rows_take_the_argmax_of_any_float_dtype() -> None:
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0))
    rows = [make_row() for _ in range(64)]
    assert sample_ids(logits, rows) == logits.argmax(dim=-1).tolist()
    half = logits.to(torch.bfloat16)
    assert sample_ids(half, rows) == half.float().argmax(dim=-1).tolist()


def test_plain_greedy_batch_skips_processing_entirely() -> None:
    # The fast path: no copy, no per-row work, one argmax.
    logits = torch.randn(64, 100)
    assert process_logits(logits, [make_row() for _ in range(64)]) is logits


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=1.0, min_p=1.0),
        SamplingParams(temperature=5.0, top_k=1, top_p=0.5),
    ],
    ids=["top_k=1", "tiny top_p", "min_p=1", "top_k=1 with hot temperature"],
)
def test_truncation_to_one_token_equals_greedy(params: SamplingParams) -> None:
    # Nearly flat logits: without the truncation the sampled tokens would almost never be the argmax.
    logits = torch.randn(32, 500, generator=torch.Generator().manual_seed(1)) * 0.01
    rows = [make_row(params, seed=i) for i in range(32)]
    assert sample_ids(logits, rows) == logits.argmax(dim=-1).tolist()


def test_untruncated_sampling_of_flat_logits_is_not_greedy() -> None:
    # Guards the test above against passing because sampling were greedy anyway.
    logits = torch.randn(32, 500, generator=torch.Generator().manual_seed(1)) * 0.01
    rows = [make_row(SamplingParams(temperature=1.0), seed=i) for i in range(32)]
    assert sum(a == b for a, b in zip(sample_ids(logits, rows), logits.argmax(dim=-1).tolist(), strict=True)) < 5


def test_seeded_row_samples_the_same_tokens_alone_or_in_any_batch() -> None:
    vocab = 2000
    torch.manual_seed(0)
    target_logits = torch.randn(vocab) * 0.5
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=500, min_p=0.01, seed=1234)

    def run(batch_before: int, batch_after: int) -> list[int]:
        tokens: list[int] = []
        for step in range(8):
            target = SamplingRow(params, noise_seed(1234, step), [1, 2, 3], tokens.copy(), frozenset())
            others_before = [make_row(SamplingParams(temperature=1.3), seed=100 + i) for i in range(batch_before)]
            others_after = [make_row(GREEDY) for _ in range(batch_after)]
            rows = [*others_before, target, *others_after]
            logits = torch.randn(len(rows), vocab)
            logits[batch_before] = target_logits
            tokens.append(sample_ids(logits, rows)[batch_before])
        return tokens

    alone = run(0, 0)
    assert run(5, 3) == alone
    assert run(0, 7) == alone
    assert run(2, 0) == alone
    assert len(set(alone)) > 1, "the sampled tokens should vary from step to step"
    other_seed = SamplingRow(params, noise_seed(99, 0), [1, 2, 3], [], frozenset())
    first_tokens = {sample_ids(target_logits.unsqueeze(0), [other_seed])[0] for _ in range(5)}
    assert first_tokens != {alone[0]}, "another seed should give other tokens"


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 3.0, 0.5]])
    row = make_row(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[0, 1], output=[2, 3, 2])
    expected = torch.tensor([[1.0, -4.0, 0.5, -2.0, 3.0, 0.5]])
    assert torch.equal(process_logits(logits, [row]), expected)


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 3.0, 0.5]])
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=1.0)
    row = make_row(params, prompt=[4, 5], output=[0, 0, 1, 0])
    # token 0: 3 times -> 2 - 0.5*3 - 1; token 1: once -> -2 - 0.5 - 1; prompt tokens untouched
    expected = torch.tensor([[-0.5, -3.5, 1.0, -1.0, 3.0, 0.5]])
    assert torch.allclose(process_logits(logits, [row]), expected)


def test_repetition_penalty_applies_before_frequency_and_presence() -> None:
    logits = torch.tensor([[4.0, -1.0, 0.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.5)
    row = make_row(params, prompt=[1], output=[0, 0])
    # token 0: 4/2 - 1*2 - 0.5; token 1 (prompt only): -1*2
    expected = torch.tensor([[-0.5, -2.0, 0.0]])
    assert torch.allclose(process_logits(logits, [row]), expected)


def test_penalties_change_the_greedy_choice_and_leave_other_rows_alone() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0], [5.0, 4.0, 0.0]])
    rows = [make_row(SamplingParams(temperature=0.0, repetition_penalty=2.0), output=[0]), make_row()]
    assert sample_ids(logits, rows) == [1, 0]
    assert torch.equal(logits, torch.tensor([[5.0, 4.0, 0.0], [5.0, 4.0, 0.0]])), "the input must stay intact"


def test_min_tokens_suppresses_eos_and_stop_token_ids_until_reached() -> None:
    logits = torch.tensor([[9.0, 8.0, 7.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1, 10**9])  # 10**9: off the vocab

    early = make_row(params, output=[3], eos=[0, 2])
    processed = process_logits(logits, [early])
    assert processed[0, :3].tolist() == [-math.inf] * 3
    assert processed[0, 3:].tolist() == [1.0, 0.0]
    assert sample_ids(logits, [early]) == [3]

    reached = make_row(params, output=[3, 4], eos=[0, 2])
    assert sample_ids(logits, [reached]) == [0]


def test_min_tokens_suppresses_eos_for_random_rows_too() -> None:
    logits = torch.tensor([[10.0, 2.0, 2.0]])
    params = SamplingParams(temperature=1.0, min_tokens=5)
    rows = [make_row(params, seed=noise_seed(3, i), output=[], eos=[0]) for i in range(50)]
    assert {sample_ids(logits, [row])[0] for row in rows} == {1, 2}


def test_logprobs_come_from_raw_logits_with_ranks_and_top_n() -> None:
    raw = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    # The penalty pushes tokens 0-3 below token 4, so the sampled token is rank 5 of the raw logits.
    params = SamplingParams(temperature=0.0, repetition_penalty=10.0, logprobs=2)
    [sampled] = Sampler()(raw, [make_row(params, prompt=[0, 1, 2, 3])])
    expected = torch.log_softmax(raw[0], dim=-1).tolist()
    assert sampled.token_id == 4
    assert sampled.logprobs is not None
    assert set(sampled.logprobs) == {4, 0, 1}
    assert sampled.logprobs[4].rank == 5
    assert sampled.logprobs[0].rank == 1 and sampled.logprobs[1].rank == 2
    for token_id, logprob in sampled.logprobs.items():
        assert logprob.logprob == pytest.approx(expected[token_id], abs=1e-6)
        assert logprob.decoded_token is None


def test_logprobs_zero_returns_only_the_sampled_token_and_none_returns_nothing() -> None:
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(2))
    rows = [make_row(SamplingParams(temperature=0.7, logprobs=0), seed=5), make_row()]
    first, second = Sampler()(logits, rows)
    assert first.logprobs is not None and list(first.logprobs) == [first.token_id]
    logprobs = torch.log_softmax(logits[0], dim=-1)
    assert first.logprobs[first.token_id].logprob == pytest.approx(logprobs[first.token_id].item(), abs=1e-6)
    expected_rank = 1 + int((logprobs > logprobs[first.token_id]).sum())
    assert first.logprobs[first.token_id].rank == expected_rank
    assert second.logprobs is None


def test_logprob_ranks_count_strictly_greater_tokens_so_ties_share_a_rank() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0]])
    [sampled] = Sampler()(logits, [make_row(SamplingParams(temperature=0.0, logprobs=3))])
    assert sampled.logprobs is not None
    assert {token_id: lp.rank for token_id, lp in sampled.logprobs.items()} == {1: 1, 2: 1, 3: 3}


PROBS = [0.5, 0.3, 0.15, 0.05]


def _renormalized(weights: list[float]) -> list[float]:
    return [w / sum(weights) for w in weights]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(temperature=1.0), PROBS),
        (SamplingParams(temperature=0.5), _renormalized([p**2 for p in PROBS])),
        (SamplingParams(temperature=1.0, top_k=2), _renormalized([0.5, 0.3, 0, 0])),
        (SamplingParams(temperature=1.0, top_p=0.75), _renormalized([0.5, 0.3, 0, 0])),
        (SamplingParams(temperature=1.0, top_p=0.85), _renormalized([0.5, 0.3, 0.15, 0])),
        (SamplingParams(temperature=1.0, min_p=0.25), _renormalized([0.5, 0.3, 0.15, 0])),
    ],
    ids=["plain", "temperature 0.5", "top_k=2", "top_p=0.75", "top_p=0.85", "min_p=0.25"],
)
def test_sampled_frequencies_follow_the_processed_distribution(params: SamplingParams, expected: list[float]) -> None:
    logits = torch.tensor([PROBS]).log()
    num_samples = 2000
    # a row's noise is a function of its seed: one seed per sample, as successive tokens of a request get
    counts = Counter(sample_ids(logits, [make_row(params, seed=noise_seed(7, i))])[0] for i in range(num_samples))
    for token_id, probability in enumerate(expected):
        frequency = counts[token_id] / num_samples
        if probability == 0:
            assert frequency == 0, f"token {token_id} should be masked"
        else:
            # about 3.5 standard deviations at p = 0.5
            assert frequency == pytest.approx(probability, abs=0.04), f"token {token_id}"


def test_min_p_applies_before_top_p_as_in_vllm() -> None:
    # min_p=0.6 keeps {0, 1} (renormalised 4/7, 3/7); top_p=0.5 then keeps token 0 only. The other order
    # would keep {0, 1}: top_p over the raw probabilities needs tokens 0 and 1 to reach 0.5.
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    params = SamplingParams(temperature=1.0, min_p=0.6, top_p=0.5)
    assert {sample_ids(logits, [make_row(params, seed=noise_seed(11, i))])[0] for i in range(200)} == {0}


def test_greedy_and_random_rows_in_one_batch() -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(4))
    logits[3] = torch.full((300,), -10.0)
    logits[3, 42] = 10.0  # a random row whose distribution is all on token 42
    rows = [make_row(), make_row(), make_row(), make_row(SamplingParams(temperature=1.0), seed=1)]
    rows += [make_row(), make_row(SamplingParams(temperature=0.8, top_k=1), seed=2)]
    sampled = sample_ids(logits, rows)
    argmax = logits.argmax(dim=-1).tolist()
    assert sampled[:3] == argmax[:3] and sampled[4:] == argmax[4:]
    assert sampled[3] == 42


def test_sampling_an_empty_batch_returns_nothing() -> None:
    assert Sampler()(torch.empty(0, 10), []) == []


def test_a_uniform_number_next_to_one_still_samples_a_token_of_positive_probability() -> None:
    # the inverse transform's edge: u x total can round up to the total, past the last positive token
    seed = next(s for s in range(10**6) if uniform_of(s) > 1 - 1e-5)
    logits = torch.tensor([[0.0, 1.0, 2.0, float("-inf"), float("-inf")]])
    assert sample_ids(logits, [make_row(SamplingParams(temperature=1.0), seed=seed)]) == [2]
    assert sample_ids(logits, [make_row(SamplingParams(temperature=1.0), seed=0)])[0] in {0, 1, 2}


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_logits_that_are_not_numbers_still_sample_a_token_of_the_vocabulary(bad: float) -> None:
    # found by the API fuzzer: such a row used to index one past the vocabulary and kill the engine
    logits = torch.tensor([[bad, 0.0, 1.0], [0.0, 1.0, 2.0]])
    rows = [make_row(SamplingParams(temperature=1.0), seed=noise_seed(5, i)) for i in range(2)]
    assert all(0 <= token < 3 for token in sample_ids(logits, rows))
