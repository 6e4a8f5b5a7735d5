"""The engine thread as asyncio sees it: commands, token streams, and a dead engine failing fast."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine import SamplingParams
from engine.async_engine import AsyncEngine, EngineDead
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.types import FinishReason, StepOutput
from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy


def make_engine(tiny_model: TinyModelFactory, async_scheduling: bool = False) -> AsyncEngine:
    return AsyncEngine(LLMEngine(EngineConfig(model=str(tiny_model("llama")), dtype="float32",
                                              skip_tokenizer_init=True, async_scheduling=async_scheduling)))


def test_tokens_stream_from_the_engine_thread(tiny_model: TinyModelFactory, async_scheduling: bool) -> None:
    engine = make_engine(tiny_model, async_scheduling)
    engine.start()
    prompt = [5, 17, 99, 4]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def run() -> list[StepOutput | EngineDead]:
        events = engine.open_stream("r")
        await engine.call(lambda e: e.add_request("r", prompt, params))
        received = []
        while not received or (isinstance(received[-1], StepOutput) and received[-1].finish_reason is None):
            received.append(await asyncio.wait_for(events.get(), 10))
        return received

    try:
        received = asyncio.run(run())
    finally:
        engine.stop()
    assert all(isinstance(e, StepOutput) for e in received)
    assert [e.token_id for e in received if isinstance(e, StepOutput)] == hf_greedy(tiny_model("llama"), [prompt], 6)[0]
    assert isinstance(received[-1], StepOutput) and received[-1].finish_reason == FinishReason.LENGTH


def test_a_dead_engine_thread_fails_streams_and_calls(tiny_model: TinyModelFactory) -> None:
    engine = make_engine(tiny_model)
    armed = []

    def explode(_: LLMEngine) -> None:
        if armed:
            raise RuntimeError("boom")

    engine.add_ticker(explode)
    engine.start()

    async def run() -> StepOutput | EngineDead:
        events = engine.open_stream("r")
        await engine.call(lambda e: armed.append(True))
        return await asyncio.wait_for(events.get(), 10)

    try:
        event = asyncio.run(run())
        assert isinstance(event, EngineDead) and "boom" in str(event)
        assert not engine.healthy
        with pytest.raises(RuntimeError, match="stopped"):
            asyncio.run(engine.call(lambda e: None))
    finally:
        engine.stop()


def test_an_idle_engine_ticks_often_only_while_a_ticker_has_work_in_flight(tiny_model: TinyModelFactory) -> None:
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(tiny_model("llama")), dtype="float32",
                                                skip_tokenizer_init=True)), idle_wait_s=0.001, rest_wait_s=5.0)
    ticks: list[float] = []
    in_flight = [True]
    engine.add_ticker(lambda _: ticks.append(time.monotonic()), in_flight=lambda: in_flight[0])
    engine.start()
    try:
        time.sleep(0.5)
        busy_ticks = len(ticks)
        in_flight[0] = False
        time.sleep(0.1)  # the tick under way when it changed
        resting_from = len(ticks)
        time.sleep(0.5)
        resting_ticks = len(ticks) - resting_from
        # a command still wakes a resting engine at once, not after rest_wait_s
        started = time.monotonic()
        assert asyncio.run(engine.call(lambda e: e.has_unfinished())) is False
        woke_after_s = time.monotonic() - started
    finally:
        engine.stop()
    assert busy_ticks >= 20, busy_ticks
    assert resting_ticks <= 1, resting_ticks
    assert woke_after_s < 2.5, woke_after_s


def test_a_loaded_engine_runs_on_the_thread_that_built_it_and_build_errors_reach_the_caller(
        tiny_model: TinyModelFactory) -> None:
    def failing() -> LLMEngine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine.load(failing)
    builder: list[threading.Thread] = []

    def build() -> LLMEngine:
        builder.append(threading.current_thread())
        return LLMEngine(EngineConfig(model=str(tiny_model("llama")), dtype="float32", block_size=4))

    loaded = AsyncEngine.load(build)
    ran_on: list[threading.Thread] = []

    async def ask() -> None:
        await loaded.call(lambda engine: ran_on.append(threading.current_thread()))

    loaded.start()
    try:
        asyncio.run(ask())
    finally:
        loaded.stop()
    assert ran_on == builder and not builder[0].is_alive()
