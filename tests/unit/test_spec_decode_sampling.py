"""Speculative decoding keeps the sampled distribution: many samples of three tokens from one fixed context, with and
without n-gram drafts, against the exact distribution transformers (float32) gives, by a chi-square test.

Tokens 2 and 3 are sampled by the verification step (token 1 comes from the prompt's step, which has no drafts):
with top_k=3 the three tokens have at most 27 outcomes, each with an exact probability from the oracle. A rule
that accepted a draft more often than p(draft), or resampled the draft after rejecting it, moves several percent
of the mass and fails by far (checked once by hand with such rules, outside the suite)."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.fixtures.spec_models import echo_prone_model
from tests.fixtures.tiny_models import TinyModelFactory, _load_oracle, hf_greedy

SPEC = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
TOP_K = 3
NUM_TOKENS = 3
NUM_SAMPLES = 1500
PARAMS = SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return echo_prone_model(tiny_model("llama"), tmp_path_factory.mktemp("spec-sampling") / "echo")


@pytest.fixture(scope="module")
def prompt(model: Path) -> list[int]:
    """A head, the oracle's greedy continuation and the head again: the likeliest next tokens recur in it."""
    rng = random.Random(1)
    head = [rng.randrange(3, 900) for _ in range(4)]
    return head + hf_greedy(model, [head], 8)[0] + head


@pytest.fixture(scope="module")
def exact(model: Path, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """The probability of every NUM_TOKENS-token outcome under top_k sampling at temperature 1 (transformers)."""
    oracle = _load_oracle(str(model.resolve()))

    def top_k_probs(context: list[int]) -> dict[int, float]:
        with torch.inference_mode():
            logits = oracle(torch.tensor([context])).logits[0, -1]
        top = logits.topk(TOP_K)
        return dict(zip(top.indices.tolist(), top.values.softmax(dim=-1).tolist(), strict=True))

    outcomes: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(NUM_TOKENS):
        outcomes = {prefix + (token,): p * q for prefix, p in outcomes.items()
                    for token, q in top_k_probs(prompt + list(prefix)).items()}
    return outcomes


def chi_square_p_value(counts: Counter[tuple[int, ...]], exact: dict[tuple[int, ...], float], num: int) -> float:
    """Pearson's test of the counts against the exact probabilities; outcomes expected fewer than 5 times are
    pooled into one cell so the chi-square approximation holds."""
    assert set(counts) <= set(exact), f"outcomes outside the top-k support: {set(counts) - set(exact)}"
    cells: list[tuple[float, float]] = []  # (observed, expected)
    rare_observed = rare_expected = 0.0
    for outcome, p in exact.items():
        if p * num >= 5:
            cells.append((counts[outcome], p * num))
        else:
            rare_observed, rare_expected = rare_observed + counts[outcome], rare_expected + p * num
    if rare_expected > 0:
        cells.append((rare_observed, rare_expected))
    statistic = sum((o - e) ** 2 / e for o, e in cells)
    degrees = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(degrees / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def sample(llm: LLM, prompt: list[int]) -> Counter[tuple[int, ...]]:
    outputs = llm.generate([prompt] * NUM_SAMPLES, PARAMS)  # unseeded: each request draws its own seed
    return Counter(tuple(o.outputs[0].token_ids) for o in outputs)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "ngram"])
def test_samples_of_three_tokens_follow_the_exact_distribution(
        model: Path, prompt: list[int], exact: dict[tuple[int, ...], float], speculative: bool) -> None:
    llm = LLM(model=str(model), dtype="float32", block_size=4, max_num_seqs=NUM_SAMPLES, seed=3, num_kv_blocks=4096,
              max_num_batched_tokens=4096, speculative_config=SPEC if speculative else None)
    counts = sample(llm, prompt)
    assert chi_square_p_value(counts, exact, NUM_SAMPLES) > 1e-3
    if speculative:
        stats = llm.engine.stats()
        # the test means something only when drafts were both accepted and rejected, often
        assert stats.spec_decode_num_drafts > NUM_SAMPLES // 3
        assert 0.2 < stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens < 0.9


def test_the_chi_square_test_rejects_a_distribution_a_few_percent_off(exact: dict[tuple[int, ...], float]) -> None:
    """The test's power: counts drawn from the exact distribution with 5% of the mass moved from the likeliest outcome
    to the second are rejected (arithmetic, no model)."""
    ranked = sorted(exact, key=exact.__getitem__, reverse=True)
    shifted = dict(exact)
    shifted[ranked[0]] -= 0.05
    shifted[ranked[1]] += 0.05
    rng = random.Random(0)
    draws = rng.choices(list(shifted), weights=list(shifted.values()), k=NUM_SAMPLES)
    assert chi_square_p_value(Counter(draws), exact, NUM_SAMPLES) < 1e-3
    assert all(len(outcome) == NUM_TOKENS for outcome in itertools.islice(exact, 3))
