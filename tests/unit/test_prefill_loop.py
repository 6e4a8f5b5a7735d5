"""The prefill node's lifecycle around a real engine thread, in process: leases, their expiry, and no pinned
block outliving a cancelled RPC."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, PinnedBlocks
from engine.types import SamplingParams
from prefill_node.loop import PrefillLoop
from tests.fixtures.tiny_models import TinyModelFactory

PROMPT = list(range(10, 21))  # 11 tokens: 3 blocks of 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def engine(tiny_model: TinyModelFactory, async_scheduling: bool) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(tiny_model("llama")), dtype="float32", block_size=4,
                                                num_kv_blocks=32, skip_tokenizer_init=True,
                                                async_scheduling=async_scheduling)))
    yield engine
    engine.stop()


def make_loop(engine: AsyncEngine, lease_s: float) -> PrefillLoop:
    # the ticket is the pinned blocks themselves here: what a ticket describes, without a transfer endpoint
    loop = PrefillLoop(engine, "p0", lease_s, lambda ticket_id, pinned, deadline: pinned)  # type: ignore[arg-type,return-value]
    engine.start()
    return loop


async def free_blocks(engine: AsyncEngine) -> tuple[int, int]:
    stats = await engine.call(lambda e: e.stats())
    return stats.free_kv_blocks, stats.total_kv_blocks


def test_a_lease_nobody_releases_expires_and_frees_the_blocks(engine: AsyncEngine) -> None:
    loop = make_loop(engine, lease_s=0.2)

    async def run() -> None:
        result = await loop.prefill("r", PROMPT, PARAMS, deadline=None)
        assert isinstance(result.ticket, PinnedBlocks) and len(result.ticket.block_ids) == 3
        assert loop.num_pinned == 1 and (await free_blocks(engine))[0] == 29
        for _ in range(100):
            if loop.num_pinned == 0:
                break
            await asyncio.sleep(0.02)
        assert loop.num_pinned == 0 and loop.num_leases_expired == 1
        free, total = await free_blocks(engine)
        assert free == total and not await engine.call(lambda e: dict(e.requests))

    asyncio.run(run())


def test_a_released_ticket_frees_its_blocks_once(engine: AsyncEngine) -> None:
    loop = make_loop(engine, lease_s=30)

    async def run() -> None:
        await loop.prefill("r", PROMPT, PARAMS, deadline=None)
        (ticket_id,) = loop._leases
        assert not await loop.release(ticket_id, loop.incarnation + 1)  # another incarnation's ticket
        assert await loop.release(ticket_id, loop.incarnation)
        assert not await loop.release(ticket_id, loop.incarnation)
        free, total = await free_blocks(engine)
        assert free == total and loop.num_pinned == 0

    asyncio.run(run())


@pytest.mark.parametrize("delay_s", [0.0, 0.001, 0.01])
def test_a_prefill_cancelled_at_any_moment_leaves_no_block_pinned(engine: AsyncEngine, delay_s: float) -> None:
    loop = make_loop(engine, lease_s=30)

    async def run() -> None:
        for i in range(5):
            task = asyncio.ensure_future(loop.prefill(f"r{i}", PROMPT, PARAMS, deadline=None))
            await asyncio.sleep(delay_s * i)  # cancel while being added, while running, or after its token
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            for ticket_id in list(loop._leases):  # a prefill that finished first holds a ticket: release it
                await loop.release(ticket_id, loop.incarnation)
        await asyncio.sleep(0.05)
        free, total = await free_blocks(engine)
        assert free == total and not await engine.call(lambda e: dict(e.requests))

    asyncio.run(run())


def test_a_lease_extends_while_the_engine_thread_is_busy_and_not_after_it_expired(engine: AsyncEngine) -> None:
    # D extends the lease before it pulls: that answer must not wait behind P's prefill step
    loop = make_loop(engine, lease_s=0.3)

    async def run() -> None:
        await loop.prefill("r", PROMPT, PARAMS, deadline=None)
        (ticket_id,) = loop._leases
        busy, release = threading.Event(), threading.Event()

        def hold(_: LLMEngine) -> None:
            busy.set()
            release.wait(5)

        held = asyncio.ensure_future(engine.call(hold))
        while not busy.is_set():
            await asyncio.sleep(0.001)
        before = time.time()
        deadline = loop.extend(ticket_id, loop.incarnation, 30.0)
        assert deadline is not None and deadline >= before + 30.0
        assert loop.extend(ticket_id, loop.incarnation + 1, 30.0) is None  # another incarnation's ticket
        release.set()
        await held
        await asyncio.sleep(0.5)  # past the original 0.3 s lease: the extension keeps it
        assert loop.num_pinned == 1 and loop.num_leases_expired == 0
        assert loop.extend(ticket_id, loop.incarnation, 0.0) is not None  # never shortens a lease
        assert await loop.release(ticket_id, loop.incarnation)
        assert loop.extend(ticket_id, loop.incarnation, 30.0) is None  # released: not live any more

    asyncio.run(run())
