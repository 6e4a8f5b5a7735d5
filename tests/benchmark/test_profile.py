"""The profile's step model and its fit: coefficients recovered from points written by hand from known costs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmark.profile import (
    DecodePoint,
    HandoffPoint,
    NodeSpec,
    Points,
    PrefillPoint,
    Profile,
    ProfileError,
    StepCost,
    attended,
    fit,
    fit_errors,
    load_profile,
    prefill_schedule,
)

NODE = NodeSpec(model="m", dtype="float32", device="cpu", threads=1, max_num_batched_tokens=512, max_num_seqs=8,
                block_size=16, num_kv_blocks=1000)
BASE, PER_TOKEN, PER_SEQ, PER_PAIR, REQUEST = 0.010, 0.0002, 0.001, 0.05, 0.030


def one_step(tokens: int, seqs: int, pairs: float) -> float:
    return BASE + PER_TOKEN * tokens + PER_SEQ * seqs + PER_PAIR * pairs / 1e6


def test_attended_counts_causal_pairs() -> None:
    assert attended(0, 1) == 1  # a first token sees itself
    assert attended(0, 4) == 1 + 2 + 3 + 4
    assert attended(10, 2) == 11 + 12


def test_schedule_packs_the_budget_in_arrival_order() -> None:
    # 3 prompts of 300 under a 512 budget: 300 + 212 of the second, then 88 + 300, nothing left over
    steps = prefill_schedule(300, 3, budget=512, max_seqs=8)
    assert [(t, s) for t, s, _ in steps] == [(512, 2), (388, 2)]
    assert steps[0][2] == attended(0, 300) + attended(0, 212)
    assert steps[1][2] == attended(212, 88) + attended(0, 300)


def test_fit_recovers_the_costs_the_points_were_made_with() -> None:
    # batch-1 prompts within the budget take one step; decode points are one step of `batch` tokens
    prefill = tuple(PrefillPoint(n, 1, REQUEST + one_step(n, 1, n * (n + 1) / 2)) for n in (16, 64, 200, 400, 500))
    decode = tuple(DecodePoint(b, c, one_step(b, b, b * c)) for b, c in ((1, 100), (4, 300), (8, 200), (2, 900)))
    handoff = (HandoffPoint(100, 0.02 + 1e-5 * 100), HandoffPoint(400, 0.02 + 1e-5 * 400))
    step, request_s, h0, h1 = fit(NODE, Points(prefill, decode, handoff))
    assert step.base_s == pytest.approx(BASE, rel=1e-3)
    assert step.per_token_s == pytest.approx(PER_TOKEN, rel=1e-3)
    assert step.per_seq_s == pytest.approx(PER_SEQ, rel=1e-3)
    assert step.per_attended_s == pytest.approx(PER_PAIR, rel=1e-3)
    assert request_s == pytest.approx(REQUEST, rel=1e-3)
    assert (h0, h1) == (pytest.approx(0.02), pytest.approx(1e-5))


def test_fit_never_goes_negative() -> None:
    # decode times that fall with the batch would need a negative per-token cost: it is clamped at 0
    decode = tuple(DecodePoint(b, 10, 0.05 - 0.001 * b) for b in (1, 2, 4, 8, 16))
    step, request_s, _, _ = fit(NODE, Points((), decode, ()))
    assert min(step.base_s, step.per_token_s, step.per_seq_s, step.per_attended_s, request_s) >= 0


def test_round_trip_and_errors(tmp_path: Path) -> None:
    points = Points((PrefillPoint(64, 1, 0.1),), (DecodePoint(1, 100, 0.02),), ())
    profile = Profile(NODE, StepCost(BASE, PER_TOKEN, PER_SEQ, PER_PAIR), REQUEST, 0.01, 0.0, points, cores=2)
    path = tmp_path / "p.json"
    profile.save(path)
    assert load_profile(path) == profile
    (label, measured, fitted), _ = fit_errors(profile)
    assert measured == 0.1 and fitted == pytest.approx(REQUEST + one_step(64, 1, 64 * 65 / 2))
    raw = json.loads(path.read_text())
    raw["format"] = "something-else"
    path.write_text(json.dumps(raw))
    with pytest.raises(ProfileError, match="not a tandem-profile/1"):
        load_profile(path)
    del raw["step"]
    raw["format"] = "tandem-profile/1"
    path.write_text(json.dumps(raw))
    with pytest.raises(ProfileError, match="missing or wrong"):
        load_profile(path)
