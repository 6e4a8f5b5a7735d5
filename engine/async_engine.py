"""Runs an LLMEngine on its own thread and serves it to asyncio code (the gRPC services of the nodes).

The engine is not thread-safe: everything that touches it runs on the engine thread, either as a command
(`await call(fn)`, fn gets the engine) or as a ticker (run every loop iteration, for lease expiry and
transfer polling). Tokens reach asyncio through one queue per request, as the engine's StepOutputs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from engine.llm_engine import LLMEngine
from engine.types import SamplingParams, StepOutput

logger = logging.getLogger(__name__)
T = TypeVar("T")


class StreamEnd(Exception):
    """Ends a request's token stream without a finishing token."""


class EngineDead(StreamEnd):
    """Sent to every open stream when the engine thread dies."""


class RequestAborted(StreamEnd):
    """Sent to a request's stream when it is aborted (so whoever waits for its tokens stops waiting)."""


class AsyncEngine:
    """`idle_wait_s`: how often an idle engine thread runs its tickers while one of them has work in flight;
    `rest_wait_s`: while none has. Commands wake the thread at once either way. Why two: on a CPU box an idle
    node's thread waking every 2 ms preempts its neighbour's OpenMP threads 500 times a second, and every
    preemption stalls a whole parallel region at its barrier (a waker of 50 us per 2 ms slowed a batch-8
    SmolLM2 decode step on the 2-core bench box from 93 to 125 ms, median)."""

    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.002, rest_wait_s: float = 0.05) -> None:
        self.engine = engine
        self._idle_wait_s = idle_wait_s
        self._rest_wait_s = rest_wait_s
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[StepOutput | StreamEnd]]] = {}
        self._tickers: list[Callable[[LLMEngine], None]] = []
        self._in_flight: list[Callable[[], bool]] = []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._go: threading.Event | None = None  # set: a thread made by load() enters the loop
        self.error: BaseException | None = None

    @classmethod
    def load(cls, build: Callable[[], LLMEngine], idle_wait_s: float = 0.002,
             rest_wait_s: float = 0.05) -> AsyncEngine:
        """build() on the thread that will run the engine; returns once it has built (its exception re-raised
        here), and start() then runs the loop on that same thread. Why the same thread: the tensor-parallel
        worker processes the build spawns die with the thread that spawned them (PR_SET_PDEATHSIG follows the
        creating thread), and GNU OpenMP keeps a team of worker threads for every thread that ever ran a parallel
        region: a loading thread's idle team beside the engine thread's own makes libgomp's workers sleep between
        regions, and every region of a CPU step then waits to wake them (a SmolLM2 decode step at batch 8 on the
        2-core bench box: 51.8 ms beside such a team, 39.5 ms without; bench/results/engine-speed-2026-12-04.md)."""
        built, go = threading.Event(), threading.Event()
        made: list[AsyncEngine] = []
        error: list[BaseException] = []

        def run() -> None:
            try:
                made.append(cls(build(), idle_wait_s, rest_wait_s))
            except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
                error.append(e)
                return
            finally:
                built.set()
            go.wait()
            made[0]._run()

        thread = threading.Thread(target=run, name="engine", daemon=True)
        thread.start()
        built.wait()
        if error:
            thread.join()
            raise error[0]
        made[0]._thread, made[0]._go = thread, go
        return made[0]

    def start(self) -> None:
        if self._go is not None:
            self._go.set()
        else:
            self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._commands.put(lambda: None)
        if self._go is not None:
            self._go.set()  # a loaded engine never started: its thread enters the loop, sees the stop and ends
        self._thread.join(timeout=10)

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def add_ticker(self, fn: Callable[[LLMEngine], None], in_flight: Callable[[], bool] | None = None) -> None:
        """fn(engine) runs on the engine thread every iteration, busy or idle. `in_flight()` says whether it has
        work in flight that wants ticks every `idle_wait_s` while the engine is idle (None: always); otherwise
        an idle engine ticks every `rest_wait_s`. Register before start()."""
        self._tickers.append(fn)
        self._in_flight.append(in_flight or (lambda: True))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs fn(engine) on the engine thread and returns its result (or raises its exception)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except BaseException as e:  # noqa: BLE001 - handed to the caller, not swallowed
                loop.call_soon_threadsafe(_set_exception, future, e)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

        if not self.healthy:
            raise RuntimeError(f"the engine thread has stopped: {self.error!r}")
        self._commands.put(run)
        return await future

    async def compile_structured_output(self, params: SamplingParams) -> None:
        """Compiles a constrained request's grammar (params.structured_outputs) into the engine's cache on a worker
        thread, so that adding the request on the engine thread finds it compiled: a compile can take a second with
        a big vocabulary, which would stall every running request there. ValueError with the reason when it does
        not compile. The compiler is thread-safe (engine/structured_output.py)."""
        if params.structured_outputs is not None:
            await asyncio.to_thread(self.engine.structured_outputs.compile, params.structured_outputs)

    def open_stream(self, request_id: str) -> asyncio.Queue[StepOutput | StreamEnd]:
        """A queue that receives the request's tokens, or a StreamEnd (aborted, engine dead) so that nobody
        waits for tokens that will never come. Open it before the request is added."""
        events: asyncio.Queue[StepOutput | StreamEnd] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), events)
        return events

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def publish(self, request_id: str, event: StepOutput | StreamEnd) -> None:
        """Sends an event to a request's stream (from the engine thread)."""
        target = self._streams.get(request_id)
        if target is not None:
            loop, events = target
            loop.call_soon_threadsafe(events.put_nowait, event)

    def abort(self, engine: LLMEngine, request_id: str) -> bool:
        """On the engine thread: aborts a request (freeing its blocks) and ends its stream. Whether it existed."""
        found = engine.abort(request_id)
        self.publish(request_id, RequestAborted(f"request {request_id} was aborted"))
        return found

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._run_commands(block=not self.engine.has_unfinished())
                for ticker in self._tickers:
                    ticker(self.engine)
                if self.engine.has_unfinished():
                    self._step()
        except BaseException as e:  # noqa: BLE001 - a dead engine thread must be visible to health checks
            logger.exception("engine thread died")
            self.error = e
            for request_id in list(self._streams):
                self.publish(request_id, EngineDead(f"the engine failed: {e!r}"))

    def _run_commands(self, block: bool) -> None:
        try:
            if block:
                in_flight = any(fn() for fn in self._in_flight)
                command = self._commands.get(timeout=self._idle_wait_s if in_flight else self._rest_wait_s)
            else:
                command = self._commands.get_nowait()
        except queue.Empty:
            return
        command()
        while True:
            try:
                self._commands.get_nowait()()
            except queue.Empty:
                return

    def _step(self) -> None:
        # one hand-over per event loop a step, not one per request: each call_soon_threadsafe wakes the loop's
        # thread, which then takes the GIL from this one (8 of them cost a SmolLM2 step at batch 8 ~1.3 ms)
        deliveries: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[StepOutput | StreamEnd], StepOutput]]] = {}
        for out in self.engine.step():
            target = self._streams.get(out.request_id)
            if target is not None:
                deliveries.setdefault(target[0], []).append((target[1], out))
        for loop, events in deliveries.items():
            loop.call_soon_threadsafe(_deliver, events)


def _deliver(events: list[tuple[asyncio.Queue[StepOutput | StreamEnd], StepOutput]]) -> None:
    for queue_, event in events:
        queue_.put_nowait(event)


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
