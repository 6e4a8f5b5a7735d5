"""What the planner reads (cluster/planner/scrape.py) from the proxy's real metrics (proxy/api/metrics.py's
ProxyMetrics, rendered to Prometheus text), and one interval of the live loop (loop.py) on them."""

from __future__ import annotations

import asyncio

import httpx

from cluster.planner.loop import PlannerLoop
from cluster.planner.policy import Planner, PolicyConfig
from cluster.planner.scrape import bucket_delta, load_window, merge, parse_scrape, quantile
from cluster.planner.types import SLO, PoolSizes
from proxy.api.metrics import ProxyMetrics
from tests.unit.test_planner_policy import gpu_profile


def _serve(metrics: ProxyMetrics, requests: int, prompt: int, tokens: int, finish: bool = True) -> None:
    for _ in range(requests):
        recorder = metrics.request(0.0, prompt)  # arrived at monotonic 0: a long TTFT
        recorder.on_tokens(1)
        recorder.on_tokens(tokens - 1)
        if finish:
            recorder.finish("length")
            recorder.close()


def test_a_window_from_two_scrapes_of_the_proxy_metrics():
    metrics = ProxyMetrics("m")
    _serve(metrics, 3, 100, 5)
    before = parse_scrape(metrics.render().decode())
    _serve(metrics, 4, 200, 10)
    _serve(metrics, 2, 50, 2, finish=False)  # still running at the end
    after = parse_scrape(metrics.render().decode())
    window = load_window(before, after, 0.0, 10.0, 90)
    assert (window.arrivals, window.completed, window.running) == (6, 4, 2)
    assert window.prompt_tokens == 4 * 200 + 2 * 50
    assert window.output_tokens == 4 * 10 + 2 * 2
    assert window.rate == 0.6 and window.ttft_s is not None and window.ttft_s > 1  # since monotonic 0
    assert window.itl_s is not None and window.itl_s <= 0.01  # the gaps were immediate


def test_an_idle_window_has_no_latencies():
    metrics = ProxyMetrics("m")
    _serve(metrics, 2, 10, 3)
    scrape = parse_scrape(metrics.render().decode())
    window = load_window(scrape, scrape, 0.0, 1.0, 90)
    assert (window.arrivals, window.ttft_s, window.itl_s) == (0, None, None)


def test_quantile_interpolates_within_the_bucket_as_histogram_quantile():
    buckets = ((0.1, 10.0), (0.5, 60.0), (1.0, 100.0), (float("inf"), 100.0))
    assert quantile(buckets, 50) == 0.1 + 0.4 * (50 - 10) / 50
    assert quantile(buckets, 100) == 1.0
    assert quantile(((1.0, 0.0), (float("inf"), 5.0)), 90) == 1.0  # beyond the last bound
    assert quantile(((1.0, 0.0), (float("inf"), 0.0)), 90) is None


def test_a_counter_reset_counts_from_zero_and_buckets_stay_cumulative():
    assert bucket_delta(((1.0, 3.0), (2.0, 4.0)), ((1.0, 10.0), (2.0, 12.0))) == ((1.0, 3.0), (2.0, 4.0))
    metrics = ProxyMetrics("m")
    _serve(metrics, 5, 10, 2)
    old = parse_scrape(metrics.render().decode())
    restarted = ProxyMetrics("m")
    _serve(restarted, 1, 10, 2)
    window = load_window(old, parse_scrape(restarted.render().decode()), 0, 1, 90)
    assert window.completed == 1 and window.prompt_tokens == 10


def test_scrapes_of_several_proxies_add_up():
    a, b = ProxyMetrics("m"), ProxyMetrics("m")
    _serve(a, 2, 10, 2)
    _serve(b, 3, 10, 2)
    merged = merge([parse_scrape(a.render().decode()), parse_scrape(b.render().decode())])
    assert merged.counters["success"] == 5 and merged.counters["prompt_tokens"] == 50


class RecordingScaler:
    def __init__(self, sizes: PoolSizes) -> None:
        self.sizes = sizes
        self.applied: list[dict[str, int]] = []

    async def current(self) -> PoolSizes:
        return self.sizes

    async def apply(self, sizes: dict[str, int]) -> None:
        self.applied.append(sizes)
        self.sizes = PoolSizes(sizes.get("prefill", self.sizes.prefill), sizes.get("decode", self.sizes.decode))


def test_one_interval_of_the_loop_scrapes_decides_applies_and_exports():
    metrics = ProxyMetrics("m")
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=metrics.render()))
    times = iter([0.0, 0.0, 10.0])
    planner = Planner(gpu_profile(), PolicyConfig(slo=SLO(0.5, 0.05), max_sizes=PoolSizes(4, 4)))
    scaler = RecordingScaler(PoolSizes(1, 1))
    loop = PlannerLoop(planner, scaler, ["http://proxy/metrics"], 10.0, clock=lambda: next(times))

    async def run() -> None:
        async with httpx.AsyncClient(transport=transport) as client:
            assert await loop.tick(client) is None  # the baseline
            _serve(metrics, 150, 100, 4, finish=False)  # 150 requests in flight: decode must grow
            decision = await loop.tick(client)
            assert decision is not None and decision.changed

    asyncio.run(run())
    assert scaler.applied and scaler.applied[0]["decode"] > 1
    text = loop.metrics.render().decode()
    assert f'tandem:planner_desired_nodes{{role="decode"}} {float(scaler.sizes.decode)}' in text
    assert 'tandem:planner_decisions_total{direction="up",reason=' in text
