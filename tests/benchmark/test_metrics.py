"""Metric arithmetic on synthetic timings; every expected value is worked out by hand below."""

from __future__ import annotations

import pytest

from benchmark.client import RequestOutput, Usage
from benchmark.metrics import calculate_metrics, parse_goodput


def _outputs() -> list[RequestOutput]:
    return [
        # 5 tokens: TTFT 100 ms, ITLs 20/30/20/30 ms, E2EL 200 ms -> TPOT (200 - 100) / 4 = 25 ms
        RequestOutput(prompt_len=10, output_tokens=5, ttft=0.1, itl=[0.02, 0.03, 0.02, 0.03], latency=0.2,
                      start_time=0.0, success=True),
        # 3 tokens: TTFT 300 ms, ITLs 50/50 ms, E2EL 400 ms -> TPOT (400 - 300) / 2 = 50 ms; overlaps the first
        RequestOutput(prompt_len=20, output_tokens=3, ttft=0.3, itl=[0.05, 0.05], latency=0.4, start_time=0.1,
                      success=True),
        # 1 token: no TPOT (counted as 0 for goodput), no ITL
        RequestOutput(prompt_len=30, output_tokens=1, ttft=0.2, itl=[], latency=0.2, start_time=1.0, success=True),
        RequestOutput(prompt_len=40, error="HTTP 500: boom"),
    ]


def test_counts_and_throughputs_cover_completed_requests_only() -> None:
    m = calculate_metrics(_outputs(), duration=2.0, percentiles=[90, 99])
    assert (m.completed, m.failed, m.errors) == (3, 1, ("HTTP 500: boom",))
    assert (m.total_input, m.total_output) == (60, 9)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.input_throughput == pytest.approx(30.0)
    assert m.output_throughput == pytest.approx(4.5)
    assert m.total_token_throughput == pytest.approx(34.5)
    assert m.request_goodput is None
    assert m.max_concurrent_requests == 2


def test_latency_statistics_in_milliseconds() -> None:
    d = calculate_metrics(_outputs(), duration=2.0, percentiles=[90, 99]).distributions
    # TTFT [100, 300, 200]: sorted [100, 200, 300]; p90 = 200 + 0.8 * 100, p99 = 200 + 0.98 * 100
    assert d["ttft"].mean == pytest.approx(200.0)
    assert d["ttft"].median == pytest.approx(200.0)
    assert d["ttft"].std == pytest.approx((20000 / 3) ** 0.5)
    assert [p for p, _ in d["ttft"].percentiles] == [90, 99]
    assert [v for _, v in d["ttft"].percentiles] == pytest.approx([280.0, 298.0])
    # TPOT [25, 50] (the one-token request has none)
    assert (d["tpot"].mean, d["tpot"].median) == pytest.approx((37.5, 37.5))
    assert [v for _, v in d["tpot"].percentiles] == pytest.approx([47.5, 49.75])
    # ITL [20, 30, 20, 30, 50, 50]: sorted [20, 20, 30, 30, 50, 50], p90 at rank 4.5 -> 50
    assert d["itl"].mean == pytest.approx(200 / 6)
    assert d["itl"].median == pytest.approx(30.0)
    assert [v for _, v in d["itl"].percentiles] == pytest.approx([50.0, 50.0])
    # E2EL [200, 400, 200]
    assert (d["e2el"].mean, d["e2el"].median) == pytest.approx((800 / 3, 200.0))


def test_goodput_counts_requests_within_every_slo() -> None:
    # ttft <= 250 and tpot <= 40: the first (100, 25) and the one-token request (200, 0) pass, the second fails
    m = calculate_metrics(_outputs(), duration=2.0, percentiles=[99], goodput_slos_ms={"ttft": 250, "tpot": 40})
    assert m.request_goodput == pytest.approx(2 / 2.0)
    m = calculate_metrics(_outputs(), duration=2.0, percentiles=[99], goodput_slos_ms={"ttft": 50})
    assert m.request_goodput == 0.0


def test_all_failed_gives_zeros_not_errors() -> None:
    m = calculate_metrics([RequestOutput(error="x"), RequestOutput(error="y")], duration=1.0, percentiles=[99])
    assert (m.completed, m.failed, m.total_output, m.output_throughput) == (0, 2, 0, 0.0)
    assert m.distributions["ttft"].mean == 0.0


def test_parse_goodput_reads_pairs_and_rejects_bad_ones() -> None:
    assert parse_goodput(["ttft:200", "tpot:50.5"]) == {"ttft": 200.0, "tpot": 50.5}
    for bad in (["ttft=200"], ["itl:5"], ["ttft:-1"], ["ttft:abc"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_prompt_cache_sums_come_from_usage_and_stay_unknown_where_it_is_not_reported() -> None:
    outputs = [RequestOutput(prompt_len=50, output_tokens=2, ttft=0.1, latency=0.2, success=True,
                             usage=Usage(50, 2, 30)),
               RequestOutput(prompt_len=70, output_tokens=2, ttft=0.1, latency=0.2, success=True,
                             usage=Usage(70, 2, 64)),
               RequestOutput(prompt_len=9, error="stream broke", usage=Usage(9, 0, 0)),  # its prefill happened
               RequestOutput(prompt_len=5, output_tokens=1, ttft=0.1, latency=0.1, success=True)]  # no usage
    m = calculate_metrics(outputs, duration=1.0, percentiles=[99])
    assert (m.total_prompt_tokens, m.total_cached_tokens, m.total_computed_prompt_tokens) == (129, 94, 35)
    m = calculate_metrics([RequestOutput(prompt_len=5, output_tokens=2, ttft=0.1, latency=0.2, success=True,
                                         usage=Usage(5, 2, None))], duration=1.0, percentiles=[99])
    assert (m.total_prompt_tokens, m.total_cached_tokens, m.total_computed_prompt_tokens) == (5, None, None)
    assert calculate_metrics(outputs[3:], duration=1.0, percentiles=[99]).total_prompt_tokens is None


def test_session_runs_get_each_turns_median_ttft_and_the_later_turns_pooled() -> None:
    def turn(number: int, ttft: float, success: bool = True) -> RequestOutput:
        return RequestOutput(prompt_len=1, output_tokens=1, ttft=ttft, latency=ttft, success=success,
                             error="" if success else "x", session_turn=number)
    # turn 1: 100, 300 -> 200; turn 2: 40 (the failed one's 900 is left out); turn 3: 20, 30 -> 25;
    # turns 2+ pooled: [20, 30, 40] -> 30
    outputs = [turn(1, 0.1), turn(1, 0.3), turn(2, 0.04), turn(2, 0.9, success=False), turn(3, 0.02),
               turn(3, 0.03)]
    m = calculate_metrics(outputs, duration=1.0, percentiles=[99])
    assert m.median_ttft_ms_by_turn == pytest.approx((200.0, 40.0, 25.0))
    assert m.median_ttft_ms_later_turns == pytest.approx(30.0)
    assert calculate_metrics(_outputs(), duration=2.0, percentiles=[99]).median_ttft_ms_by_turn == ()
