from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

import engine.truncation
from engine.truncation import apply_min_p, apply_top_k_top_p

# How far from top_p the mass before a token must be for the definition below, in float64, to decide the token
# for certain: float32 softmaxes sum some 50,000 terms for their normaliser, and the sum is up to about 1e-5 off.
TOLERANCE = 2e-5


def assert_truncated_as_defined(
    original: torch.Tensor, truncated: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]
) -> None:
    """Checks `truncated` against the definition, computed here in float64 with a full sort: the top_k largest
    logits and every logit equal to the k-th stay; then, in descending order of logit, a token stays while the
    softmax mass strictly before it is below top_p. Tokens of equal logits come in any order, so what is defined
    is how many of each logit stay; a token within TOLERANCE of the cutoff may go either way."""
    kept = truncated > -math.inf
    # Kept tokens keep their logits, bit for bit; the rest are -inf.
    assert torch.equal(truncated[kept], original[kept])
    assert bool((truncated[~kept] == -math.inf).all())
    vocab_size = original.shape[1]
    for i in range(original.shape[0]):
        descending, order = original[i].double().sort(descending=True)
        masked = descending
        if 0 < top_k[i] < vocab_size:
            masked = torch.where(descending >= descending[top_k[i] - 1], descending, -math.inf)
        finite = masked > -math.inf
        probs = masked.softmax(dim=0)
        mass_before = probs.cumsum(dim=0) - probs
        if top_p[i] >= 1:
            fewest = most = finite
        else:
            fewest = finite & (mass_before < top_p[i] - TOLERANCE)
            most = finite & (mass_before < top_p[i] + TOLERANCE)
        # group[j]: which distinct logit the j-th largest token has
        group = torch.cat([torch.zeros(1, dtype=torch.long), (descending[1:] != descending[:-1]).long().cumsum(0)])
        flags = torch.stack([kept[i][order], fewest, most]).long()
        num_kept, num_fewest, num_most = torch.zeros(3, int(group[-1]) + 1, dtype=torch.long).index_add_(
            1, group, flags
        )
        wrong = ((num_kept < num_fewest) | (num_kept > num_most)).nonzero().flatten().tolist()
        assert not wrong, [
            f"row {i} (top_k {top_k[i]}, top_p {top_p[i]}): {int(num_kept[g])} tokens of logit "
            f"{float(descending[group == g][0])} kept, the definition keeps {int(num_fewest[g])}..{int(num_most[g])}"
            for g in wrong[:3]
        ]


def truncated(logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> torch.Tensor:
    out = logits.clone()
    apply_top_k_top_p(out, torch.tensor(top_k), torch.tensor(top_p, dtype=torch.float32))
    return out


@pytest.fixture
def sorted_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of rows each call of the full-sort path gets (the GPU's path, and the CPU's fallback)."""
    calls: list[int] = []
    by_sort = engine.truncation._top_k_top_p_by_sort

    def counting(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
        calls.append(logits.shape[0])
        by_sort(logits, top_k, top_p)

    monkeypatch.setattr(engine.truncation, "_top_k_top_p_by_sort", counting)
    return calls


TOP_K = [0, 1, 5, 50, 400, 0, 20, 0, 1000, 50000, 0]
TOP_P = [0.95, 1.0, 0.5, 1.0, 0.9, 0.99, 0.3, 1e-6, 0.8, 0.7, 1.0]


@pytest.mark.parametrize("vocab_size", [1000, 49152])
@pytest.mark.parametrize("num_rows", [1, 11, 64])
@pytest.mark.parametrize("temperature", [0.3, 1.0, 4.0], ids=["peaked", "randn", "flat"])
def test_mixed_top_k_and_top_p_rows_keep_the_tokens_of_the_definition(
    vocab_size: int, num_rows: int, temperature: float
) -> None:
    generator = torch.Generator().manual_seed(vocab_size + num_rows)
    logits = torch.randn(num_rows, vocab_size, generator=generator) * 3 / temperature
    top_k = [TOP_K[i % len(TOP_K)] for i in range(num_rows)]
    top_p = [TOP_P[(i + num_rows) % len(TOP_P)] for i in range(num_rows)]
    assert_truncated_as_defined(logits, truncated(logits, top_k, top_p), top_k, top_p)


def test_peaked_rows_are_settled_without_the_full_sort(sorted_rows: list[int]) -> None:
    logits = torch.randn(16, 49152, generator=torch.Generator().manual_seed(1)) * 3 / 0.8
    top_p = [0.95] * 16
    assert_truncated_as_defined(logits, truncated(logits, [0] * 16, top_p), [0] * 16, top_p)
    assert sorted_rows == []


def test_flat_rows_fall_back_to_the_full_sort(sorted_rows: list[int]) -> None:
    generator = torch.Generator().manual_seed(2)
    # Rows 0 and 2 are flat: top_p 0.99 of them is most of the vocabulary. Row 1 is peaked.
    logits = torch.randn(3, 49152, generator=generator) * torch.tensor([[0.01], [4.0], [0.5]])
    top_p = [0.99, 0.99, 0.99]
    assert_truncated_as_defined(logits, truncated(logits, [0, 0, 0], top_p), [0, 0, 0], top_p)
    assert sorted_rows == [2]


@pytest.mark.parametrize("margin", [-0.3, -0.002])
def test_rows_whose_candidates_fall_short_of_top_p_go_to_the_sort(
    margin: float, sorted_rows: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Candidates chosen to hold less mass than top_p: far less, then a little less, so that some rows' candidates
    # do reach top_p and others just miss it.
    monkeypatch.setattr(engine.truncation, "_CANDIDATE_MARGIN", margin)
    logits = torch.randn(64, 49152, generator=torch.Generator().manual_seed(9)) * 3
    top_p = [0.5, 0.9, 0.95, 0.99] * 16
    assert_truncated_as_defined(logits, truncated(logits, [0] * 64, top_p), [0] * 64, top_p)
    assert len(sorted_rows) == 1 and (sorted_rows[0] == 64 if margin == -0.3 else 0 < sorted_rows[0] < 64)


def test_tied_logits_anywhere_keep_as_many_of_each_value_as_the_definition() -> None:
    # Logits on a grid of 0.25: every value is shared by many tokens, at the cutoff too.
    generator = torch.Generator().manual_seed(3)
    logits = torch.randint(-40, 0, (32, 4096), generator=generator).float() / 4
    top_k = [0, 0, 100, 0] * 8
    top_p = [0.9, 0.5, 0.95, 0.99] * 8
    assert_truncated_as_defined(logits, truncated(logits, top_k, top_p), top_k, top_p)


def test_many_ties_away_from_the_cutoff_all_stay_or_all_go() -> None:
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 1000, generator=generator)
    logits[:, :200] = 3.0  # 200 tokens tied at the top hold three quarters of the mass
    logits[:, 200:400] = -8.0  # and 200 tied far below the cutoff
    top_p = [0.9, 0.95, 0.99, 0.999]
    out = truncated(logits, [0] * 4, top_p)
    assert bool((out[:, :200] == 3.0).all())
    assert bool((out[:, 200:400] == -math.inf).all())
    assert_truncated_as_defined(logits, out, [0] * 4, top_p)


def test_mass_of_exactly_top_p_before_a_token_drops_it() -> None:
    # Four equal tokens have probability 0.25 exactly: the third has 0.5 before it.
    logits = torch.full((2, 1000), -math.inf)
    logits[:, 10:14] = 1.0
    out = truncated(logits, [0, 0], [0.5, 0.5000001])
    assert (out > -math.inf).sum(dim=1).tolist() == [2, 3]


def test_rows_of_a_few_finite_tokens() -> None:
    generator = torch.Generator().manual_seed(5)
    logits = torch.full((6, 49152), -math.inf)
    for i, num_finite in enumerate([1, 2, 3, 10, 50, 300]):
        ids = torch.randperm(49152, generator=generator)[:num_finite]
        logits[i, ids] = torch.randn(num_finite, generator=generator) * 2
    top_k = [0, 0, 2, 0, 20, 0]
    top_p = [0.5, 0.999, 0.9, 0.9, 0.95, 0.8]
    assert_truncated_as_defined(logits, truncated(logits, top_k, top_p), top_k, top_p)


@pytest.mark.parametrize("rows_with_truncation", [[0], [1, 5], list(range(8))])
def test_top_k_only_and_top_p_only_on_some_rows(rows_with_truncation: list[int]) -> None:
    generator = torch.Generator().manual_seed(6)
    logits = torch.randn(8, 3000, generator=generator) * 2
    for top_k, top_p in (
        ([7 if i in rows_with_truncation else 0 for i in range(8)], [1.0] * 8),
        ([0] * 8, [0.8 if i in rows_with_truncation else 1.0 for i in range(8)]),
    ):
        out = truncated(logits, top_k, top_p)
        assert_truncated_as_defined(logits, out, top_k, top_p)
        untouched = [i for i in range(8) if i not in rows_with_truncation]
        assert torch.equal(out[untouched], logits[untouched])


def test_top_k_keeps_every_token_tied_with_the_kth() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0]])
    assert truncated(logits, [2], [1.0]).tolist() == [[3.0, -math.inf, 2.0, 2.0, 2.0, -math.inf]]


def test_rows_that_are_not_numbers_go_to_the_sort_and_leave_the_other_rows_alone(sorted_rows: list[int]) -> None:
    # A softmax of NaN or inf is NaN, negative NaN here: binned by its bits it would land in the previous row's
    # bins (or at a negative index).
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 1000, generator=generator) * 3
    logits[1, 17] = math.nan
    logits[3, 5] = math.inf
    logits[5] = -math.inf
    out = truncated(logits, [0] * 6, [0.9] * 6)
    assert sorted_rows == [3]
    good = [0, 2, 4]
    assert_truncated_as_defined(logits[good], out[good], [0] * 3, [0.9] * 3)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes_take_the_full_sort_with_the_same_semantics(dtype: torch.dtype, sorted_rows: list[int]) -> None:
    generator = torch.Generator().manual_seed(8)
    logits = (torch.randn(6, 2000, generator=generator) * 3).to(dtype)
    top_k = [0, 10, 0, 100, 0, 1]
    top_p = [0.9, 1.0, 0.5, 0.95, 0.99, 0.5]
    out = truncated(logits, top_k, top_p)
    assert sorted_rows == [6]
    # bfloat16's own softmax is too coarse for the float64 definition's tolerance but for top_k alone.
    rows = range(6) if dtype == torch.float64 else [1]
    assert_truncated_as_defined(logits[rows], out[rows], [top_k[i] for i in rows], [top_p[i] for i in rows])


def test_min_p_drops_tokens_below_min_p_times_the_largest_probability() -> None:
    logits = torch.tensor([[0.0, -math.log(2), -math.log(4), -math.log(8)], [0.0, 0.0, -1.0, -50.0]])
    apply_min_p(logits, torch.tensor([0.3, 0.01]))
    kept = (logits > -math.inf).tolist()
    # probabilities proportional to 1, 1/2, 1/4, 1/8: 1/4 < 0.3; and e^-50 < 0.01
    assert kept == [[True, True, False, False], [True, True, True, False]]
