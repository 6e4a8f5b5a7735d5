"""The planner's live loop: every interval, scrape the proxies' /metrics into a LoadWindow (scrape.py), ask the
policy (policy.py), and apply its sizes through a scaler:

- `PoolScaler`: the PoolManager of the `tandem serve` it runs in (`tandem serve --planner`), as the admin API's
  /scale does (set the desired sizes, wake the control loop);
- `AdminScaler`: the admin API of a `tandem serve` over HTTP (a planner outside it);
- `KubernetesScaler`: a Helm release's pool Deployments (cluster/kubernetes.py; the chart's planner Deployment).

Every decision is a log line (at INFO when it changes a pool or its cause, else DEBUG) and metrics:
tandem:planner_desired_nodes{role}, tandem:planner_current_nodes{role}, tandem:planner_decisions_total{role,
direction, reason} (reason: the cause code of policy.py), tandem:planner_planned_request_rate; `tandem serve`
exports them on its admin address (/metrics, open), the standalone planner on --metrics-port.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Sequence
from typing import Protocol
from urllib.parse import urlsplit, urlunsplit

import httpx
import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from cluster.planner.policy import ROLES, Planner
from cluster.planner.scrape import Scrape, load_window, merge, parse_scrape
from cluster.planner.types import Decision, PoolSizes

logger = logging.getLogger("cluster.planner")
prometheus_client.disable_created_metrics()  # as the proxy's (proxy/api/metrics.py): no *_created series


class Scaler(Protocol):
    async def current(self) -> PoolSizes: ...

    async def apply(self, sizes: dict[str, int]) -> None: ...


class PoolScaler:
    """The pools of the `tandem serve` this runs in; `wake` starts the control loop's next step at once."""

    def __init__(self, pools: object, wake: Callable[[], None]) -> None:
        self.pools = pools
        self.wake = wake

    async def current(self) -> PoolSizes:
        desired = self.pools.desired  # type: ignore[attr-defined]
        return PoolSizes(desired["prefill"], desired["decode"])

    async def apply(self, sizes: dict[str, int]) -> None:
        self.pools.scale(sizes)  # type: ignore[attr-defined]
        self.wake()


class AdminScaler:
    """A `tandem serve`'s admin API (cluster/admin.py)."""

    def __init__(self, url: str, token: str) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"}

    async def current(self) -> PoolSizes:
        async with httpx.AsyncClient(timeout=10) as client:
            r = await client.get(self.url + "/status", headers=self.headers)
        r.raise_for_status()
        pools = r.json()["pools"]
        return PoolSizes(int(pools["prefill"]["desired"]), int(pools["decode"]["desired"]))

    async def apply(self, sizes: dict[str, int]) -> None:
        async with httpx.AsyncClient(timeout=10) as client:
            r = await client.post(self.url + "/scale", json=sizes, headers=self.headers)
        if r.status_code >= 400:
            raise RuntimeError(f"the admin API refused {sizes}: {r.status_code} {r.text[:300]}")


class KubernetesScaler:
    """A Helm release's pools (cluster/kubernetes.py), from inside the cluster or with a kubeconfig."""

    def __init__(self, namespace: str, release: str, kubeconfig: str | None = None) -> None:
        from cluster.kubernetes import KubernetesPools

        self.pools = KubernetesPools(namespace, release, kubeconfig=kubeconfig)

    async def current(self) -> PoolSizes:
        prefill, decode = await asyncio.gather(*(asyncio.to_thread(self.pools.replicas, r) for r in ROLES))
        return PoolSizes(prefill, decode)

    async def apply(self, sizes: dict[str, int]) -> None:
        for role, size in sizes.items():
            result = await asyncio.to_thread(self.pools.scale, role, size)
            logger.info("kubernetes: %s", result.describe())


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.desired = Gauge("tandem:planner_desired_nodes", "Nodes the planner wants, by role.", ["role"],
                             registry=self.registry)
        self.current = Gauge("tandem:planner_current_nodes", "Nodes the pool had when the planner decided.",
                             ["role"], registry=self.registry)
        self.decisions = Counter("tandem:planner_decisions", "Planner decisions, by role, direction (up, down, "
                                 "hold) and reason (the rule that decided).", ["role", "direction", "reason"],
                                 registry=self.registry)
        self.rate = Gauge("tandem:planner_planned_request_rate", "Requests per second the planner sized for.",
                          registry=self.registry)
        self.errors = Counter("tandem:planner_errors", "Intervals the planner could not scrape, decide or apply.",
                              registry=self.registry)

    def record(self, decision: Decision, rate: float) -> None:
        self.rate.set(rate)
        for action in decision.actions:
            self.desired.labels(action.role).set(action.desired)
            self.current.labels(action.role).set(action.current)
            self.decisions.labels(action.role, action.direction, action.cause).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def expand(url: str) -> list[str]:
    """The URL once per address its host resolves to (a headless Service: every proxy pod)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    try:
        addresses = sorted({info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)})
    except OSError:
        return [url]
    netloc = lambda a: f"[{a}]:{port}" if ":" in a else f"{a}:{port}"  # noqa: E731
    return [urlunsplit(parts._replace(netloc=netloc(a))) for a in addresses] or [url]


class PlannerLoop:
    def __init__(self, planner: Planner, scaler: Scaler, metrics_urls: Sequence[str], interval_s: float,
                 metrics: PlannerMetrics | None = None, resolve_all: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.planner = planner
        self.scaler = scaler
        self.metrics_urls = list(metrics_urls)
        self.interval_s = interval_s
        self.metrics = metrics or PlannerMetrics()
        self.resolve_all = resolve_all
        self.clock = clock
        self._last: tuple[float, Scrape] | None = None
        self._last_causes: tuple[str, ...] = ()
        self._started = clock()

    async def scrape(self, client: httpx.AsyncClient) -> Scrape:
        urls = [u for url in self.metrics_urls for u in (expand(url) if self.resolve_all else [url])]
        texts = []
        for url in urls:
            r = await client.get(url, timeout=5)
            r.raise_for_status()
            texts.append(r.text)
        return merge(parse_scrape(t) for t in texts)

    async def tick(self, client: httpx.AsyncClient) -> Decision | None:
        """One interval: None on the first (the baseline scrape) or when the scrape failed."""
        now = self.clock()
        try:
            scrape = await self.scrape(client)
        except (httpx.HTTPError, ValueError) as e:
            self.metrics.errors.inc()
            logger.warning("planner: cannot scrape %s: %s", self.metrics_urls, e)
            return None
        last, self._last = self._last, (now, scrape)
        if last is None:
            return None
        window = load_window(last[1], scrape, last[0] - self._started, now - last[0],
                             self.planner.config.slo.percentile)
        current = await self.scaler.current()
        decision = self.planner.decide(now - self._started, window, current)
        self.metrics.record(decision, max(self.planner.planned_rate, 0.0))
        causes = tuple(a.cause for a in decision.actions)
        level = logging.INFO if decision.changed or causes != self._last_causes else logging.DEBUG
        self._last_causes = causes
        logger.log(level, "planner: %s", decision.reason)
        if decision.changed:
            changes = {a.role: a.desired for a in decision.actions if a.direction != "hold"}
            await self.scaler.apply(changes)
        return decision

    async def run(self, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient() as client:
            while not stop.is_set():
                started = self.clock()
                try:
                    await self.tick(client)
                except Exception as e:  # noqa: BLE001 - one bad interval must not end the planner
                    self.metrics.errors.inc()
                    logger.warning("planner: interval failed: %r", e)
                left = self.interval_s - (self.clock() - started)
                try:
                    await asyncio.wait_for(stop.wait(), timeout=max(left, 0.05))
                except TimeoutError:
                    pass
