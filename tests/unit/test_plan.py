"""`tandem plan` (cluster/planner/plan.py) and its capacity model (capacity.py): the analytic bounds, the simulator's
check and adjustment, the CLI's table and JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmark.profile import NodeSpec, Profile, StepCost
from cluster.cli import main
from cluster.planner.capacity import Load, capacity, decode_batch, prefill_rate, ttft_quantile
from cluster.planner.plan import make_plan, simulate_check, workload
from cluster.planner.types import SLO, PoolSizes

SLO_ = SLO(ttft_s=0.4, itl_s=0.04, percentile=90)


def gpu_profile(num_kv_blocks: int = 20000, max_seqs: int = 128) -> Profile:
    node = NodeSpec("m", "bfloat16", "cuda", 0, 2048, max_seqs, 16, num_kv_blocks)
    return Profile(node, StepCost(0.012, 0.00006, 0.0001, 0.002), request_s=0.01, handoff_base_s=0.005,
                   handoff_per_token_s=1e-6)


def test_decode_batch_is_bounded_by_the_itl_slo_the_seats_and_the_kv_blocks():
    p = gpu_profile()
    batch = decode_batch(p, 1088, 1152, SLO_.itl_s)
    assert p.decode_step_s(batch, 1088) <= SLO_.itl_s < p.decode_step_s(batch + 1, 1088) or batch == 128
    assert decode_batch(gpu_profile(max_seqs=8), 1088, 1152, SLO_.itl_s) == 8
    assert decode_batch(gpu_profile(num_kv_blocks=72 * 3), 1088, 1152, SLO_.itl_s) == 3  # 72 blocks each
    assert decode_batch(p, 1088, 1152, 0.001) == 0


def test_prefill_rate_is_where_the_ttft_percentile_meets_the_slo():
    p = gpu_profile()
    rate = prefill_rate(p, [1024], SLO_)
    assert rate > 0
    assert ttft_quantile(p, [1024], rate * 0.999, 90) <= SLO_.ttft_s + 1e-6
    assert ttft_quantile(p, [1024], rate * 1.05, 90) > SLO_.ttft_s
    assert prefill_rate(p, [1024], SLO(0.01, 1.0)) == 0  # not even one prompt alone


def test_nodes_scale_with_the_load():
    cap = capacity(gpu_profile(), SLO_, Load(10, 1024, 128))
    assert cap.nodes(10) == PoolSizes(math.ceil(10 / cap.prefill_rate), math.ceil(10 / cap.decode_rate))
    assert cap.nodes(0) == PoolSizes(1, 1)
    assert cap.nodes(100).total > cap.nodes(10).total


def test_colocating_every_prompt_leaves_prefill_nothing():
    cap = capacity(gpu_profile(), SLO(2.0, 0.2), Load(2, 32, 64), colocate_max_tokens=64)
    assert cap.colocated_share == 1 and math.isinf(cap.prefill_rate) and cap.decode_rate > 0


def test_the_simulator_adjusts_the_analytic_answer_to_the_least_that_meets_the_slos():
    p, load = gpu_profile(), Load(20, 1024, 128, 0.5)
    plan = make_plan(p, SLO_, load, duration_s=40)
    best = plan.best
    assert best is not None and best.check is not None and best.check.meets(SLO_)
    assert best.answer == best.checked
    requests = workload(load, 40, 0)
    for role in ("prefill", "decode"):
        if getattr(best.answer, role) > 1:
            smaller = PoolSizes(**{**best.answer.__dict__, role: getattr(best.answer, role) - 1})
            assert not simulate_check(p, SLO_, smaller, best.colocate_max_tokens, requests).meets(SLO_)


def test_tandem_plan_prints_the_candidates_and_the_answer(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    path = tmp_path / "node.json"
    gpu_profile().save(path)
    args = ["plan", "--profile", str(path), "--slo-ttft-ms", "400", "--slo-itl-ms", "40", "--request-rate", "20",
            "--input-len", "1024", "--output-len", "128", "--sim-duration-s", "30"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "colocate" in out and "simulated" in out
    assert "20 req/s" in out and "prefill +" in out and "decode nodes" in out
    assert main([*args, "--json", "--no-sim"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["answer"]["prefill"] >= 1 and body["answer"]["decode"] >= 1 and not body["simulated"]
    assert [c["colocate_max_tokens"] for c in body["candidates"]][0] == 0


def test_tandem_plan_refuses_a_file_that_is_not_a_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    path = tmp_path / "x.json"
    path.write_text("{}")
    code = main(["plan", "--profile", str(path), "--slo-ttft-ms", "400", "--slo-itl-ms", "40", "--request-rate",
                 "1", "--input-len", "10", "--output-len", "10"])
    assert code == 2 and "not a tandem-profile/1 file" in capsys.readouterr().err
