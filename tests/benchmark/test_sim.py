"""The simulator against closed forms: step times from the profile's coefficients, worked out by hand."""

from __future__ import annotations

import math

import pytest

from benchmark.profile import NodeSpec, Profile, StepCost
from benchmark.sim import SimRequest, simulate
from cluster.planner.types import Decision, LoadWindow, PoolSizes

BASE, PER_TOKEN, PER_SEQ, PER_PAIR = 0.01, 0.001, 0.0005, 0.1  # per million pairs
REQUEST_S, HANDOFF_BASE, HANDOFF_PER_TOKEN = 0.005, 0.02, 0.0001


def profile(num_kv_blocks: int = 1000, budget: int = 256, max_seqs: int = 8, cores: int = 0) -> Profile:
    spec = NodeSpec(model="m", dtype="float32", device="cpu", threads=0, max_num_batched_tokens=budget,
                    max_num_seqs=max_seqs, block_size=16, num_kv_blocks=num_kv_blocks)
    return Profile(node=spec, step=StepCost(BASE, PER_TOKEN, PER_SEQ, PER_PAIR), request_s=REQUEST_S,
                   handoff_base_s=HANDOFF_BASE, handoff_per_token_s=HANDOFF_PER_TOKEN, cores=cores)


def step(tokens: int, seqs: int, pairs: float) -> float:
    return BASE + PER_TOKEN * tokens + PER_SEQ * seqs + PER_PAIR * pairs / 1e6


def prefill_600() -> float:
    """Prompt of 600 tokens alone, budget 256: chunks (0, 256), (256, 256), (512, 88)."""
    return (step(256, 1, 256 * 257 / 2) + step(256, 1, 256 * 256 + 256 * 257 / 2)
            + step(88, 1, 88 * 512 + 88 * 89 / 2))


def decode(context: int) -> float:
    """One decode step of one request whose new token follows `context` computed ones."""
    return step(1, 1, context + 1)


def test_one_request_alone_colocated() -> None:
    result = simulate(profile=profile(), requests=[SimRequest(0.0, 600, 4)], prefill_nodes=0, decode_nodes=1)
    out = result.outputs[0]
    assert result.colocated == [True]
    assert out.ttft == pytest.approx(REQUEST_S + prefill_600())
    assert out.itl == pytest.approx([decode(600), decode(601), decode(602)])
    assert out.output_tokens == 4
    assert out.latency == pytest.approx(out.ttft + sum(out.itl))
    assert result.metrics.distributions["tpot"].mean == pytest.approx(1000 * sum(out.itl) / 3)
    assert result.duration_s == pytest.approx(out.latency)
    assert result.node_seconds == pytest.approx(result.duration_s)


def test_disaggregated_second_token_waits_for_the_handoff() -> None:
    result = simulate(profile=profile(), requests=[SimRequest(0.0, 600, 3)], prefill_nodes=1, decode_nodes=1)
    out = result.outputs[0]
    assert result.colocated == [False]
    assert out.ttft == pytest.approx(REQUEST_S + prefill_600())
    assert out.itl == pytest.approx([HANDOFF_BASE + HANDOFF_PER_TOKEN * 600 + decode(600), decode(601)])
    assert result.node_seconds == pytest.approx(2 * out.latency)


def test_short_prompt_is_colocated_and_one_token_request_ends_on_p() -> None:
    result = simulate(profile=profile(), requests=[SimRequest(0.0, 32, 2), SimRequest(10.0, 600, 1)],
                      prefill_nodes=1, decode_nodes=1)
    assert result.colocated == [True, False]
    assert result.outputs[1].latency == pytest.approx(REQUEST_S + prefill_600())
    assert result.duration_s == pytest.approx(10.0 + REQUEST_S + prefill_600())


def test_prompts_queue_for_the_budget() -> None:
    """Four 256-token prompts of one output token at once, budget 256: one prompt per step."""
    requests = [SimRequest(0.0, 256, 1) for _ in range(4)]
    result = simulate(profile=profile(), requests=requests, prefill_nodes=0, decode_nodes=1)
    s = step(256, 1, 256 * 257 / 2)
    assert [o.ttft for o in result.outputs] == pytest.approx([REQUEST_S + k * s for k in (1, 2, 3, 4)])


def test_concurrency_limit_sends_the_next_request_when_one_ends() -> None:
    requests = [SimRequest(0.0, 256, 1) for _ in range(3)]
    result = simulate(profile=profile(), requests=requests, prefill_nodes=0, decode_nodes=1, max_concurrency=1)
    one = REQUEST_S + step(256, 1, 256 * 257 / 2)
    assert [o.ttft for o in result.outputs] == pytest.approx([one] * 3)
    assert [o.start_time for o in result.outputs] == pytest.approx([0.0, one, 2 * one])
    assert result.metrics.max_concurrent_requests == 1


@pytest.mark.parametrize(("cores", "slowdown"), [(1, 2.0), (2, 1.0), (0, 1.0)])
def test_processor_sharing(cores: int, slowdown: float) -> None:
    """Two decode nodes each prefill one prompt at the same time; one core makes each step take twice as long."""
    requests = [SimRequest(0.0, 256, 1), SimRequest(0.0, 256, 1)]
    result = simulate(profile=profile(), requests=requests, prefill_nodes=0, decode_nodes=2, cores=cores)
    s = step(256, 1, 256 * 257 / 2)
    assert [o.ttft for o in result.outputs] == pytest.approx([REQUEST_S + slowdown * s] * 2)


def test_profile_cores_is_the_default_bound() -> None:
    requests = [SimRequest(0.0, 256, 1), SimRequest(0.0, 256, 1)]
    result = simulate(profile=profile(cores=1), requests=requests, prefill_nodes=0, decode_nodes=2)
    assert result.outputs[0].ttft == pytest.approx(REQUEST_S + 2 * step(256, 1, 256 * 257 / 2))


def test_sharing_changes_mid_step() -> None:
    """cores=1: a short step and a long one start together; the long one runs at half speed until the short
    one ends (at 2 x its time), then at full speed."""
    requests = [SimRequest(0.0, 16, 1), SimRequest(0.0, 256, 1)]
    result = simulate(profile=profile(), requests=requests, prefill_nodes=0, decode_nodes=2, cores=1)
    short, long = step(16, 1, 16 * 17 / 2), step(256, 1, 256 * 257 / 2)
    assert result.outputs[0].ttft == pytest.approx(REQUEST_S + 2 * short)
    assert result.outputs[1].ttft == pytest.approx(REQUEST_S + 2 * short + (long - short))


def test_kv_capacity_makes_a_request_wait() -> None:
    """30 blocks of 16 tokens: a 400-token prompt (25 blocks) leaves no room for a second one until it ends."""
    requests = [SimRequest(0.0, 400, 10), SimRequest(0.0, 400, 10)]
    small = simulate(profile=profile(num_kv_blocks=30, budget=512), requests=requests, prefill_nodes=0,
                     decode_nodes=1)
    first, second = small.outputs
    prefill = step(400, 1, 400 * 401 / 2)
    assert first.ttft == pytest.approx(REQUEST_S + prefill)
    assert second.ttft == pytest.approx(first.latency + prefill)
    big = simulate(profile=profile(budget=512), requests=requests, prefill_nodes=0, decode_nodes=1)
    assert big.outputs[1].ttft < second.ttft - 0.05  # admitted with the first, not after it


def test_a_dry_pool_preempts_and_every_request_still_ends() -> None:
    requests = [SimRequest(0.0, 200, 200) for _ in range(3)]
    result = simulate(profile=profile(num_kv_blocks=30), requests=requests, prefill_nodes=0, decode_nodes=1)
    assert result.metrics.completed == 3
    assert [o.output_tokens for o in result.outputs] == [200] * 3


def test_a_request_larger_than_the_pool_fails() -> None:
    result = simulate(profile=profile(num_kv_blocks=10), requests=[SimRequest(0.0, 400, 1)], prefill_nodes=0,
                      decode_nodes=1)
    assert result.metrics.failed == 1 and "KV pool" in result.metrics.errors[0]


def test_saturated_decode_nodes_overload() -> None:
    requests = [SimRequest(0.0, 100, 50) for _ in range(5)]  # max_num_seqs 2: saturated at 4
    result = simulate(profile=profile(max_seqs=2), requests=requests, prefill_nodes=0, decode_nodes=1)
    assert (result.metrics.completed, result.metrics.failed) == (4, 1)


def test_deterministic() -> None:
    from benchmark.sim.workload import random_requests

    requests = random_requests(60, 300, 20, range_ratio=0.5, request_rate=20.0, seed=3)
    runs = [simulate(profile=profile(), requests=requests, prefill_nodes=1, decode_nodes=2, cores=2)
            for _ in range(2)]
    assert runs[0].outputs == runs[1].outputs
    assert runs[0].metrics == runs[1].metrics


class FixedController:
    """Asks for `sizes` at its first call and keeps them."""

    def __init__(self, sizes: PoolSizes) -> None:
        self.sizes = sizes
        self.seen: list[tuple[float, LoadWindow, PoolSizes]] = []

    def decide(self, now: float, window: LoadWindow, current: PoolSizes) -> Decision:
        self.seen.append((now, window, current))
        return Decision(self.sizes, "fixed", self.sizes != current)


def test_controller_scales_up_after_the_startup() -> None:
    requests = [SimRequest(0.25 + 0.5 * k, 100, 20) for k in range(40)]
    controller = FixedController(PoolSizes(prefill=0, decode=2))
    result = simulate(profile=profile(), requests=requests, prefill_nodes=0, decode_nodes=1, controller=controller,
                      interval_s=5.0, node_startup_s=2.0)
    assert result.metrics.completed == 40
    now, window, current = controller.seen[0]
    assert (now, current) == (5.0, PoolSizes(0, 1))
    assert window.arrivals == 10 and window.prompt_tokens == 1000  # sends at 0.25, 0.75, ..., 4.75
    assert window.duration_s == 5.0 and window.ttft_s is not None and window.itl_s is not None
    assert [(p.t, p.serving.decode, p.alive.decode) for p in result.timeline] == [(0.0, 1, 1), (5.0, 1, 2),
                                                                                (7.0, 2, 2)]
    assert result.decode_node_seconds == pytest.approx(2 * result.duration_s - 5.0)
    assert result.prefill_node_seconds == 0.0
    assert sum(w.arrivals for w in result.windows) == len(
        [r for r in requests if r.arrival_s < controller.seen[-1][0]])


def test_drained_node_finishes_its_requests_then_stops() -> None:
    requests = [SimRequest(0.0, 100, 300), SimRequest(0.0, 100, 300)]
    controller = FixedController(PoolSizes(prefill=0, decode=1))
    result = simulate(profile=profile(), requests=requests, prefill_nodes=0, decode_nodes=2, controller=controller,
                      interval_s=1.0)
    assert result.metrics.completed == 2 and result.metrics.failed == 0
    assert [(p.serving.decode, p.alive.decode) for p in result.timeline] == [(2, 2), (1, 2), (1, 1)]
    stop = result.timeline[-1].t
    assert 1.0 < stop <= result.duration_s
    assert stop == pytest.approx(result.outputs[1].latency)  # the drained node (the last one) ran request 1
    assert result.decode_node_seconds == pytest.approx(result.duration_s + stop)
    assert not math.isnan(result.node_seconds)
