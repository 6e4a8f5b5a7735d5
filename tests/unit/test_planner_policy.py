"""The planner's policy (cluster/planner/policy.py), rule by rule, on a GPU-like profile: sizing from the capacity
model, the floor of the work in flight and queued, the SLO correction, min/max, cooldown, hysteresis, and the
prediction (EWMA with trend, never below the last observed rate); then the policy driving the simulator."""

from __future__ import annotations

import math

import pytest

from benchmark.profile import NodeSpec, Profile, StepCost
from cluster.planner.capacity import Load, capacity
from cluster.planner.policy import Planner, PolicyConfig
from cluster.planner.types import SLO, LoadWindow, PoolSizes

SLO_ = SLO(ttft_s=0.5, itl_s=0.05, percentile=90)
INTERVAL = 10.0


def gpu_profile() -> Profile:
    node = NodeSpec("m", "bfloat16", "cuda", 0, max_num_batched_tokens=2048, max_num_seqs=64, block_size=16,
                    num_kv_blocks=20000)
    return Profile(node, StepCost(0.012, 0.00006, 0.0001, 0.002), request_s=0.01, handoff_base_s=0.005,
                   handoff_per_token_s=1e-6)


def window(rate: float, *, isl: int = 1000, osl: int = 100, running: int = 0, ttft: float | None = None,
           itl: float | None = None, queued: int = 0, start: float = 0.0) -> LoadWindow:
    arrivals = round(rate * INTERVAL)
    return LoadWindow(start_s=start, duration_s=INTERVAL, arrivals=arrivals, prompt_tokens=arrivals * isl,
                      output_tokens=arrivals * osl, completed=arrivals, ttft_s=ttft, itl_s=itl, running=running,
                      waiting_prefill_tokens=queued)


def planner(**overrides: object) -> Planner:
    config = PolicyConfig(slo=SLO_, min_sizes=PoolSizes(1, 1), max_sizes=PoolSizes(16, 16), cooldown_s=60,
                          down_windows=3, colocate_max_tokens=0)
    return Planner(gpu_profile(), PolicyConfig(**{**config.__dict__, **overrides}))  # type: ignore[arg-type]


def action(decision, role):  # type: ignore[no-untyped-def]
    return next(a for a in decision.actions if a.role == role)


def test_sizes_each_pool_from_the_capacity_model():
    cap = capacity(gpu_profile(), SLO_, Load(20, 1000, 100), 0)
    expected = cap.nodes(20, 0.8)
    decision = planner().decide(0, window(20), PoolSizes(1, 1))
    assert decision.sizes == expected and decision.changed
    assert expected.prefill > 1 and expected.decode >= 1
    assert action(decision, "prefill").cause == "load" and action(decision, "prefill").direction == "up"
    assert "prefill 1->" in decision.reason and "decode" in decision.reason


def test_idle_cluster_stays_at_the_minimum():
    decision = planner().decide(0, window(0), PoolSizes(1, 1))
    assert decision.sizes == PoolSizes(1, 1) and not decision.changed
    assert {a.cause for a in decision.actions} == {"steady"}


def test_decode_never_below_what_the_requests_in_flight_need():
    p = planner()
    batch = capacity(gpu_profile(), SLO_, Load(0.1, 1000, 100), 0).decode_batch
    decision = p.decide(0, window(0.1, running=3 * batch + 1), PoolSizes(1, 1))
    assert decision.sizes.decode == 4
    assert action(decision, "decode").cause == "in_flight"


def test_prefill_grows_for_queued_prompt_tokens():
    decision = planner().decide(0, window(0.1, queued=40_000), PoolSizes(1, 1))
    assert decision.sizes.prefill > 1 and action(decision, "prefill").cause == "queue"


def test_an_itl_slo_miss_grows_decode_in_proportion_capped():
    p = planner(max_correction=2.0)
    decision = p.decide(0, window(0.1, itl=3 * SLO_.itl_s), PoolSizes(1, 3))
    assert decision.sizes.decode == 6  # 3 nodes x min(3, 2)
    assert action(decision, "decode").cause == "slo_itl"


def test_a_ttft_slo_miss_grows_prefill_by_at_least_one():
    decision = planner().decide(0, window(0.1, ttft=SLO_.ttft_s * 1.1), PoolSizes(2, 1))
    assert decision.sizes.prefill == 3 and action(decision, "prefill").cause == "slo_ttft"


def test_min_and_max_bound_each_pool():
    p = planner(max_sizes=PoolSizes(2, 2), min_sizes=PoolSizes(1, 2))
    decision = p.decide(0, window(500), PoolSizes(1, 2))
    assert decision.sizes == PoolSizes(2, 2)
    assert action(decision, "decode").cause in ("max", "steady")
    assert action(decision, "prefill").cause == "max"
    assert planner(min_sizes=PoolSizes(2, 3)).decide(0, window(0), PoolSizes(1, 1)).sizes == PoolSizes(2, 3)


def test_cooldown_allows_one_change_per_pool_per_window():
    p = planner(cooldown_s=60)
    first = p.decide(0, window(15), PoolSizes(1, 1))
    assert first.changed
    grown = first.sizes
    held = p.decide(30, window(60), grown)
    assert action(held, "prefill").cause == "cooldown" and held.sizes.prefill == grown.prefill
    later = p.decide(61, window(60), grown)
    assert later.sizes.prefill > grown.prefill


def test_scale_down_waits_for_consecutive_low_windows():
    p = planner(cooldown_s=0, down_windows=3)
    big = PoolSizes(6, 6)
    steps = [p.decide(t * INTERVAL, window(0.1), big) for t in range(3)]
    assert [s.sizes for s in steps[:2]] == [big, big]
    assert [action(s, "prefill").cause for s in steps[:2]] == ["hysteresis", "hysteresis"]
    assert steps[2].sizes == PoolSizes(1, 1) and action(steps[2], "decode").cause == "idle"


def test_scale_down_waits_for_the_low_intervals_to_span_the_stabilisation_time():
    """Short intervals: three quiet ones in a row are 3 x INTERVAL of evidence; shrinking also waits until the
    quiet intervals span `down_after_s` (a cooldown by default), as HPA's scale-down stabilisation does."""
    p = planner(cooldown_s=0, down_windows=3, down_after_s=5 * INTERVAL)
    big = PoolSizes(6, 6)
    steps = [p.decide((t + 1) * INTERVAL, window(0.1, start=t * INTERVAL), big) for t in range(5)]
    assert all(s.sizes == big for s in steps[:4]), [s.sizes for s in steps]  # 4 intervals: not yet
    assert "4/5" not in action(steps[3], "decode").detail and "s below" in action(steps[3], "decode").detail
    assert steps[4].sizes == PoolSizes(1, 1)  # the fifth makes 5 x INTERVAL


def test_the_stabilisation_time_defaults_to_the_cooldown():
    p = planner(cooldown_s=4 * INTERVAL, down_windows=1)
    big = PoolSizes(6, 6)
    first = [p.decide((t + 1) * INTERVAL, window(0.1, start=t * INTERVAL), big) for t in range(3)]
    assert all(s.sizes == big for s in first)
    assert p.decide(4 * INTERVAL, window(0.1, start=3 * INTERVAL), big).sizes == PoolSizes(1, 1)


def test_a_busy_window_resets_the_scale_down_count():
    p = planner(cooldown_s=0, down_windows=2)
    big = PoolSizes(4, 4)
    p.decide(0, window(0.1), big)
    busy = p.decide(10, window(0.1, itl=SLO_.itl_s * 1.5), big)  # an SLO miss: no shrinking
    assert busy.sizes.decode >= 4
    assert p.decide(20, window(0.1), big).sizes.decode == 4  # counting starts again
    assert p.decide(30, window(0.1), big).sizes.decode == 1


def test_scale_down_needs_a_margin_below_the_low_watermark():
    profile = gpu_profile()
    cap = capacity(profile, SLO_, Load(1, 1000, 100), 0)
    # exactly the load of 2 prefill nodes at 70 %: above the 60 % watermark, so 3 stay (cooldown off)
    rate = 0.7 * 2 * cap.prefill_rate
    p = planner(cooldown_s=0, down_windows=1, utilisation=0.75)
    decision = p.decide(0, window(rate), PoolSizes(3, 8))
    assert decision.sizes.prefill == 3 and action(decision, "prefill").cause == "hysteresis"


def test_prediction_takes_the_last_rate_when_it_rises_and_the_ewma_when_it_falls():
    p = planner(cooldown_s=0, down_windows=1)
    p.decide(0, window(1), PoolSizes(1, 1))
    assert p.decide(10, window(40), PoolSizes(1, 1)).changed
    assert p.planned_rate >= 40  # a jump is planned for at once
    p.decide(20, window(0), PoolSizes(4, 2))
    assert p.planned_rate >= 10  # a drop decays: EWMA 0.5 of 20.5, plus the rising trend
    for t in range(3, 10):
        p.decide(t * 10, window(0), PoolSizes(4, 2))
    assert p.planned_rate < 1


def test_lengths_follow_what_is_observed():
    long_prompts = planner().decide(0, window(5, isl=4000, osl=500), PoolSizes(1, 1)).sizes
    short_prompts = planner().decide(0, window(5, isl=100, osl=500), PoolSizes(1, 1)).sizes
    assert long_prompts.prefill > short_prompts.prefill


def test_an_infeasible_slo_asks_for_the_maximum():
    p = Planner(gpu_profile(), PolicyConfig(slo=SLO(0.5, 0.001), max_sizes=PoolSizes(3, 5)))
    decision = p.decide(0, window(1), PoolSizes(1, 1))
    assert decision.sizes.decode == 5


def test_the_policy_drives_the_simulator_up_and_down():
    from benchmark.sim import SimRequest, simulate

    # 60 s quiet, 120 s busy, 120 s quiet
    requests, t = [], 0.0
    for start, end, rate in ((0, 60, 0.5), (60, 180, 12), (180, 300, 0.5)):
        t = max(t, start)
        while t < end:
            requests.append(SimRequest(arrival_s=t, prompt_tokens=1000, output_tokens=100))
            t += 1 / rate
    controller = planner(cooldown_s=20, down_windows=2)
    result = simulate(profile=gpu_profile(), requests=requests, prefill_nodes=1, decode_nodes=1,
                      colocate_max_tokens=0, controller=controller, interval_s=10, node_startup_s=5)
    sizes = [d.sizes for _, d in result.decisions]
    peak = max(s.prefill for s in sizes)
    assert peak > 1, sizes
    assert sizes[-1].prefill < peak  # given back once quiet
    assert result.metrics.failed == 0
    assert all(not math.isnan(w.rate) for w in result.windows)


@pytest.mark.parametrize("field", ["prefill", "decode"])
def test_every_action_names_its_pool_and_a_known_cause(field: str):
    decision = planner().decide(0, window(30, running=50), PoolSizes(1, 1))
    a = action(decision, field)
    assert a.cause in {"load", "in_flight", "queue", "slo_ttft", "slo_itl", "idle", "min", "max", "cooldown",
                       "steady", "hysteresis"}
