"""A multi-turn-session run: conversations sent turn by turn, each turn's history carrying the server's own replies.

A session's life (one asyncio task per session):
1. open: takes one of `max_active_sessions` slots (every session is open from the start without that limit) and
   keeps it to the end, think times included.
2. for each turn k = 1, 2, ...:
   a. think: sleeps the turn's think time after turn k - 1's reply (none before turn 1);
   b. build: the history is [system prompt], user 1, reply 1, ..., user k, where reply j is the text turn j
      streamed back;
   c. arrive: waits for its send time from the run's `Pacer` (ready turns queue first come, first served);
   d. send: holds one of `max_concurrency` slots while the request streams (the wait for the slot is not part
      of its latency, as for the other datasets);
   e. record: its output, tagged with its turn number k.
3. close: after its last turn, or after a failed turn (there is no reply to go on with): the turns it never sent
   are recorded as failed, so a run accounts for every one of its num_prompts requests.

So `--max-concurrency` bounds session turns in flight, and `--request-rate` bounds how often turns are sent, both
with the meaning they have for the other datasets; think times and the turns' own latencies space a session's
turns on top of that.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import numpy as np

from benchmark.client import RequestOutput, RequestSettings, send_request
from benchmark.datasets import ChatMessage, SampleRequest, Session
from benchmark.runner import (
    LoadSettings,
    RunOutput,
    arrival_offsets,
    check_load,
    concurrency_limit,
    http_client,
    progress_bar,
    warm_up,
)


class Pacer:
    """Send times for turns that become ready at times nobody knows in advance.

    The i-th turn to arrive is sent at max(its arrival, send i-1 + gap i), with send 0 the run's start and the
    gaps those of the other datasets' arrival schedule (exponential of mean 1 / rate, gamma with `burstiness`).
    When turns are always waiting this is exactly that schedule; a turn that comes late is sent at once, and
    the gap before the next one counts from it, so the rate is never exceeded on average. An infinite rate
    sends every turn as it arrives.
    """

    def __init__(self, num_sends: int, request_rate: float, seed: int, burstiness: float, start: float) -> None:
        offsets = arrival_offsets(num_sends, request_rate, seed, burstiness)
        self._gaps = iter([float(g) for g in np.diff([0.0, *offsets])])
        self._unpaced = math.isinf(request_rate)
        self._last_send = start
        self._lock = asyncio.Lock()  # asyncio's locks are fair: waiting turns go in the order they arrived

    async def wait_for_send_time(self) -> None:
        if self._unpaced:
            return
        async with self._lock:
            arrived = time.perf_counter()
            gap = next(self._gaps, None)
            assert gap is not None, "more sends than the pacer was made for"
            send_at = max(arrived, self._last_send + gap)
            if (delay := send_at - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            self._last_send = send_at


def turn_request(history: Sequence[ChatMessage], prompt_len: int, output_len: int) -> SampleRequest:
    """The request of a session's next turn: its whole history (flattened to `prompt` too)."""
    return SampleRequest("".join(m.content for m in history), prompt_len, output_len, tuple(history))


def first_turn_request(session: Session) -> SampleRequest:
    turn = session.turns[0]
    return turn_request([*_opening(session), ChatMessage("user", turn.user_message)],
                        session.system_prompt_len + turn.user_len, turn.expected_output_len)


async def run_sessions(sessions: Sequence[Session], settings: RequestSettings, load: LoadSettings) -> RunOutput:
    """Run every session (see the module's docstring) and collect every turn's output, failures included, in
    session order (session 1's turns first, in turn order)."""
    if not settings.chat:
        raise ValueError("multi-turn-session sends chats: use the chat endpoint (--endpoint /v1/chat/completions)")
    num_turns = sum(len(s.turns) for s in sessions)
    if num_turns == 0:
        raise ValueError("the workload has no requests (--num-prompts)")
    check_load(load)
    if load.max_active_sessions is not None and load.max_active_sessions <= 0:
        raise ValueError("--multi-turn-max-active-sessions must be positive")
    session_slots: contextlib.AbstractAsyncContextManager[Any] = (
        asyncio.Semaphore(load.max_active_sessions) if load.max_active_sessions else contextlib.nullcontext())
    async with http_client(load) as client:
        limit = concurrency_limit(load)
        # warm-up: the first session's first turn, as the other datasets repeat their first prompt
        await warm_up(client, settings, first_turn_request(sessions[0]), load, limit)
        progress = progress_bar(num_turns, load.disable_tqdm)
        start = time.perf_counter()
        pacer = Pacer(num_turns, load.request_rate, load.seed, load.burstiness, start)

        async def run_session(session: Session) -> list[RequestOutput]:
            async with session_slots:
                return await _converse(client, settings, session, pacer, limit, progress.update)

        per_session = await asyncio.gather(*(run_session(s) for s in sessions))
        duration = time.perf_counter() - start
        progress.close()
    return RunOutput([output for outputs in per_session for output in outputs], duration)


def _opening(session: Session) -> list[ChatMessage]:
    return [ChatMessage("system", session.system_prompt)] if session.system_prompt else []


async def _converse(client: httpx.AsyncClient, settings: RequestSettings, session: Session, pacer: Pacer,
                    limit: contextlib.AbstractAsyncContextManager[Any], done: Callable[[int], Any]
                    ) -> list[RequestOutput]:
    """Steps 2 and 3 of a session's life. `prompt_len` (the count used where the server reports no usage) is
    the system prompt's and the user turns' lengths plus the earlier replies' output tokens."""
    history = _opening(session)
    prompt_len = session.system_prompt_len
    outputs: list[RequestOutput] = []
    for number, turn in enumerate(session.turns, 1):
        if number > 1 and turn.think_time_s > 0:
            await asyncio.sleep(turn.think_time_s)
        history.append(ChatMessage("user", turn.user_message))
        prompt_len += turn.user_len
        request = turn_request(history, prompt_len, turn.expected_output_len)
        await pacer.wait_for_send_time()
        async with limit:
            output = await send_request(client, settings, request)
        output.session_turn = number
        outputs.append(output)
        done(1)
        if not output.success:
            skipped = range(number + 1, len(session.turns) + 1)
            outputs += [RequestOutput(error=f"not sent: turn {number} of its session failed ({output.error})",
                                      session_turn=k) for k in skipped]
            done(len(skipped))
            break
        history.append(ChatMessage("assistant", output.generated_text))
        prompt_len += output.output_tokens
    return outputs
