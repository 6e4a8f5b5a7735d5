"""The simulator's workloads and its CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmark.profile import NodeSpec, Profile, StepCost
from benchmark.runner import arrival_offsets
from benchmark.sim.cli import main
from benchmark.sim.types import SimRequest
from benchmark.sim.workload import DayShape, day_trace, load_trace, random_requests, save_trace


def test_random_requests_as_bench_serve_draws_them() -> None:
    requests = random_requests(200, 100, 20, range_ratio=0.5, request_rate=4.0, seed=7)
    assert [r.arrival_s for r in requests] == arrival_offsets(200, 4.0, 7)
    assert all(50 <= r.prompt_tokens <= 150 and 10 <= r.output_tokens <= 30 for r in requests)
    assert len({r.prompt_tokens for r in requests}) > 20
    fixed = random_requests(3, 100, 20)
    assert fixed == [SimRequest(0.0, 100, 20)] * 3


def test_trace_round_trip_and_errors(tmp_path: Path) -> None:
    requests = [SimRequest(1.5, 10, 2), SimRequest(0.5, 20, 3)]
    save_trace(requests, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == sorted(requests, key=lambda r: r.arrival_s)
    (tmp_path / "alt.jsonl").write_text('{"timestamp": 0, "input_len": 5, "output_len": 1}\n\n')
    assert load_trace(tmp_path / "alt.jsonl") == [SimRequest(0.0, 5, 1)]
    (tmp_path / "bad.jsonl").write_text('{"arrival_s": 0}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_trace(tmp_path / "bad.jsonl")


def test_day_trace_follows_its_shape() -> None:
    shape = DayShape(duration_s=1000.0, night_rate=1.0, peak_rate=10.0, bursts=0, short_input_len=100,
                     long_input_len=1000, range_ratio=0.0)
    requests = day_trace(shape, seed=1)
    assert requests == day_trace(shape, seed=1) and requests != day_trace(shape, seed=2)
    assert all(0 <= r.arrival_s < 1000 for r in requests)
    thirds = [[r for r in requests if k * 1000 / 3 <= r.arrival_s < (k + 1) * 1000 / 3] for k in range(3)]
    assert len(thirds[1]) > 1.5 * max(len(thirds[0]), len(thirds[2]))  # the peak at midday
    expected = 1000 * (1.0 + 10.0) / 2  # the raised cosine's mean rate
    assert abs(len(requests) - expected) < 4 * math.sqrt(expected)
    assert thirds[0][0].prompt_tokens < 150 and thirds[2][-1].prompt_tokens > 900
    bursty = DayShape(duration_s=1000.0, night_rate=1.0, peak_rate=1.0, bursts=1, burst_factor=5.0, burst_s=100.0)
    assert len(day_trace(bursty, seed=3)) > 1000 + 200  # one burst of 100 s at 5x


def write_profile(path: Path) -> Path:
    spec = NodeSpec("m", "float32", "cpu", 0, 256, 8, 16, 1000)
    Profile(spec, StepCost(0.01, 0.001, 0.0005, 0.1), 0.005, 0.02, 0.0001, cores=2).save(path)
    return path


def test_cli_prints_the_bench_serve_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = write_profile(tmp_path / "p.json")
    code = main(["--profile", str(profile), "--prefill-nodes", "1", "--decode-nodes", "1", "--num-prompts", "20",
                 "--input-len", "300", "--output-len", "10", "--range-ratio", "0.2", "--max-concurrency", "4",
                 "--json", str(tmp_path / "out.json")])
    assert code == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Maximum request concurrency:             4" in printed
    assert "P99 TTFT (ms):" in printed and "Node-seconds:" in printed
    body = json.loads((tmp_path / "out.json").read_text())
    assert body["completed"] == 20 and body["max_concurrency"] == 4 and body["node_seconds"] > 0
    assert body["timeline"][0]["serving"] == {"prefill": 1, "decode": 1}


def test_cli_trace_and_colocated_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = write_profile(tmp_path / "p.json")
    save_trace([SimRequest(0.1 * k, 40, 5) for k in range(10)], tmp_path / "t.jsonl")
    assert main(["--profile", str(profile), "--prefill-nodes", "0", "--decode-nodes", "2", "--cores", "0",
                 "--trace", str(tmp_path / "t.jsonl")]) == 0
    assert "Colocated requests:                      10" in capsys.readouterr().out
    assert main(["--profile", str(tmp_path / "missing.json"), "--prefill-nodes", "0", "--decode-nodes", "1",
                 "--trace", str(tmp_path / "t.jsonl")]) == 2
