"""A run: send a workload's requests on a schedule, at most `max_concurrency` at once, and time the whole.

Arrivals: with a finite `request_rate` (requests/s) the gaps between sends are exponential (a Poisson process;
gamma-distributed with vLLM's `burstiness` other than 1), drawn from the run's seed; with `inf` every request is
sent at once. The concurrency limit holds requests back on the client (the gap between a request's arrival and
its send is not part of its latency, as in vLLM).
Warm-up requests (the workload's first prompt, repeated) run before the clock starts and are not counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import numpy as np

from benchmark.client import RequestOutput, RequestSettings, send_request
from benchmark.datasets import SampleRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadSettings:
    request_rate: float = math.inf
    burstiness: float = 1.0  # 1: Poisson; < 1 burstier, > 1 more even (gamma-distributed gaps, as vLLM's)
    max_concurrency: int | None = None
    max_active_sessions: int | None = None  # multi-turn-session: sessions open at once (None: all of them)
    num_warmups: int = 0
    seed: int = 0
    request_timeout_s: float = 6 * 3600
    disable_tqdm: bool = False


@dataclass(frozen=True)
class RunOutput:
    outputs: list[RequestOutput]
    duration: float  # seconds, first send to last answer


class _Progress(Protocol):
    def update(self, n: int = 1) -> Any: ...
    def close(self) -> Any: ...


class _PlainProgress:
    """A progress line for when tqdm is not installed: `done/total` every 10%."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self._next = total, 0, 0.1

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.done >= self.total * self._next or self.done == self.total:
            print(f"  {self.done}/{self.total} requests", file=sys.stderr, flush=True)
            self._next += 0.1

    def close(self) -> None:
        pass


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, disable: bool) -> _Progress:
    if disable:
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return _PlainProgress(total)
    return tqdm(total=total, unit="req")  # type: ignore[no-any-return]


def arrival_offsets(num_requests: int, request_rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Seconds from the run's start at which each request arrives: all 0 for an infinite rate, else the
    cumulative sums of gamma gaps of mean 1 / rate and shape `burstiness` (1: exponential gaps, a Poisson
    process); the first request waits one gap too, as in vLLM."""
    if request_rate <= 0:
        raise ValueError("--request-rate must be positive (or inf)")
    if burstiness <= 0:
        raise ValueError("--burstiness must be positive")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (request_rate * burstiness), size=num_requests)
    return [float(t) for t in np.cumsum(gaps)]


def check_load(load: LoadSettings) -> None:
    if load.max_concurrency is not None and load.max_concurrency <= 0:
        raise ValueError("--max-concurrency must be positive")


def http_client(load: LoadSettings) -> httpx.AsyncClient:
    """A client with one connection per allowed request in flight (no limit without `max_concurrency`)."""
    limit = load.max_concurrency or 0  # httpx: 0 would mean none; `None` below means no limit
    limits = httpx.Limits(max_connections=limit or None, max_keepalive_connections=limit or None)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(load.request_timeout_s, connect=30.0))


def concurrency_limit(load: LoadSettings) -> contextlib.AbstractAsyncContextManager[Any]:
    """What a request holds while in flight: a semaphore of `max_concurrency` slots, or nothing."""
    return asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else contextlib.nullcontext()


async def warm_up(client: httpx.AsyncClient, settings: RequestSettings, sample: SampleRequest, load: LoadSettings,
                  limit: contextlib.AbstractAsyncContextManager[Any]) -> None:
    """`load.num_warmups` uncounted copies of `sample`, under the concurrency limit; failures are logged."""
    if load.num_warmups <= 0:
        return
    logger.info("warming up with %d requests", load.num_warmups)

    async def warm() -> RequestOutput:
        async with limit:
            return await send_request(client, settings, sample)

    warm_outputs = await asyncio.gather(*(warm() for _ in range(load.num_warmups)))
    failed = [o.error for o in warm_outputs if not o.success]
    if failed:
        logger.warning("%d of %d warm-up requests failed, e.g. %s", len(failed), len(warm_outputs), failed[0])


async def run_requests(samples: Sequence[SampleRequest], settings: RequestSettings, load: LoadSettings
                       ) -> RunOutput:
    """Send every sample, on schedule, and collect what each one did (failures included)."""
    if not samples:
        raise ValueError("the workload has no requests (--num-prompts)")
    check_load(load)
    async with http_client(load) as client:
        limit = concurrency_limit(load)
        await warm_up(client, settings, samples[0], load, limit)
        progress = progress_bar(len(samples), load.disable_tqdm)

        async def one(sample: SampleRequest) -> RequestOutput:
            async with limit:
                output = await send_request(client, settings, sample)
            progress.update(1)
            return output

        offsets = arrival_offsets(len(samples), load.request_rate, load.seed, load.burstiness)
        start = time.perf_counter()
        tasks = []
        for sample, offset in zip(samples, offsets, strict=True):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(sample)))
        outputs = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        progress.close()
    return RunOutput(outputs, duration)
