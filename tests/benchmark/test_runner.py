"""Arrival schedules: all at once for an infinite rate; gaps of mean 1 / rate, exponential (Poisson) or gamma."""

from __future__ import annotations

import math

import numpy as np
import pytest

from benchmark.runner import arrival_offsets


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_offsets(5, math.inf, seed=0) == [0.0] * 5


@pytest.mark.parametrize("burstiness", [1.0, 4.0])
def test_gaps_have_mean_one_over_rate_and_the_spread_burstiness_gives(burstiness: float) -> None:
    offsets = arrival_offsets(20000, 4.0, seed=1, burstiness=burstiness)
    gaps = np.diff([0.0, *offsets])
    assert np.all(gaps >= 0) and offsets == sorted(offsets)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    # a gamma of shape k has coefficient of variation 1 / sqrt(k): 1 for Poisson arrivals, 0.5 for k = 4
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_the_schedule_is_reproducible_from_the_seed_and_bad_rates_are_refused() -> None:
    assert arrival_offsets(10, 2.0, seed=3) == arrival_offsets(10, 2.0, seed=3)
    assert arrival_offsets(10, 2.0, seed=3) != arrival_offsets(10, 2.0, seed=4)
    for rate, burstiness in ((0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)):
        with pytest.raises(ValueError):
            arrival_offsets(3, rate, seed=0, burstiness=burstiness)
