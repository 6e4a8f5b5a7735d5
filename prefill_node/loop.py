"""The prefill node's request lifecycle, around the engine thread. No gRPC here (service.py is the edge).

A request's life on a prefill node (P):
1. `Prefill` arrives: the prompt is validated and added to the engine to produce one token, with
   `pin_blocks`: it finishes as FINISHED_PINNED, its K/V blocks kept (engine/request.py has the states).
2. The engine schedules it like any other (chunked prefill, prefix-cache hits) and samples the first token
   (within the request's grammar, when it has structured output: compiled first, off the engine thread). With
   prompt_logprobs it computes those too, from every prompt position's logits (so without prefix-cache hits):
   they go back with the first token.
3. If that token already ends the request (EOS, a stop token id, max_tokens=1, the context limit), the
   blocks are freed (`free_pinned`) and no ticket is issued.
4. Otherwise a lease is recorded and a KV ticket returned: block ids, per-block checksums, this node's
   incarnation, its connector metadata and the lease deadline.
5. The decode node (D) pulls the blocks over the connector, then calls `Release`: the blocks are freed.
   While D waits for room, `ExtendLease` moves the deadline.
6. `Abort` frees the request at any stage (`abort`), also when the RPC is cancelled while the request is
   being added. A lease past its deadline is freed by the ticker and counted: KV is never stranded on P.
   Tickets of an earlier incarnation (P restarted) are refused.

Timings (wire.PrefillTimings, back with the first token): queue is the RPC's arrival (step 1) to the engine step
that first schedules the prompt (step 2, the engine's Request.first_scheduled_at), prefill that step to the first
token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from engine.async_engine import AsyncEngine, RequestAborted, StreamEnd
from engine.llm_engine import LLMEngine, PinnedBlocks
from engine.request import Request
from engine.types import FinishReason, SamplingParams, StepOutput
from node_common.store_tier import StoreTier
from wire import KVTicket, PrefillTimings

logger = logging.getLogger(__name__)


class PrefillError(Exception):
    """A request P cannot serve; `code` names the gRPC status the service maps it to."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Lease:
    ticket_id: str
    request_id: str
    deadline: float


@dataclass(frozen=True)
class PrefillResult:
    first: StepOutput
    ticket: KVTicket | None  # None when the first token finished the request
    num_cached_tokens: int
    timings: PrefillTimings


class PrefillLoop:
    def __init__(self, engine: AsyncEngine, node_id: str, lease_s: float,
                 make_ticket: Callable[[str, PinnedBlocks, float], KVTicket], store: StoreTier | None = None) -> None:
        """make_ticket(ticket_id, pinned blocks, lease deadline) runs on the engine thread and describes
        the request's pinned blocks (ids, checksums, transfer endpoint). With a cluster KV `store`, a prompt's
        blocks are got from it before the prefill and put in it after."""
        self.engine = engine
        self.store = store
        self.node_id = node_id
        self.incarnation = secrets.randbits(62)  # a restarted node never honours an older ticket
        self.lease_s = lease_s
        self._make_ticket = make_ticket
        # by ticket id. Made, dropped and expired on the engine thread (which frees the blocks), extended on the
        # event loop: an extension must not wait behind a prefill step of P (up to hundreds of ms for a long
        # prompt) while D holds its second token. The lock makes "extend" and "expire" exclusive, so a lease
        # whose extension succeeded is not expired by a deadline read before it.
        self._leases: dict[str, Lease] = {}
        self._leases_lock = threading.Lock()
        self.num_leases_expired = 0
        # lease deadlines are seconds long: an idle engine's rest between ticks is precise enough
        engine.add_ticker(self._expire_leases, in_flight=lambda: False)

    @property
    def num_pinned(self) -> int:
        return len(self._leases)

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      deadline: float | None) -> PrefillResult:
        # One token here: min_tokens >= 1 suppresses EOS for the first token exactly as the full request would.
        arrival = time.monotonic()
        first_params = dataclasses.replace(params, n=1, max_tokens=1, min_tokens=min(params.min_tokens, 1),
                                           stop=[])
        try:  # a constrained request's grammar compiles off the engine thread (engine/async_engine.py)
            await self.engine.compile_structured_output(params)
        except ValueError as e:
            raise PrefillError("INVALID_ARGUMENT", str(e)) from e
        staged = await self.store.fetch(prompt_token_ids) if self.store is not None else []
        events = self.engine.open_stream(request_id)
        added = False
        try:
            try:
                added = True  # from here the engine may hold the request, whatever happens to this RPC

                def add(e: LLMEngine) -> Request:
                    if self.store is not None:
                        self.store.stage(e, staged)
                    return e.add_request(request_id, prompt_token_ids, first_params, pin_blocks=True)

                request = await self.engine.call(add)
            except ValueError as e:
                added = False
                raise PrefillError("INVALID_ARGUMENT", str(e)) from e
            timeout = None if deadline is None else max(0.0, deadline - time.time())
            first = await asyncio.wait_for(events.get(), timeout)
            first_at = time.monotonic()
        except BaseException as e:
            if added:  # cancelled or timed out: the request (and its blocks) must not outlive the RPC
                await asyncio.shield(self.engine.call(lambda eng: self.engine.abort(eng, request_id)))
            if isinstance(e, TimeoutError):
                raise PrefillError("DEADLINE_EXCEEDED", f"request {request_id} passed its deadline in prefill") from e
            raise
        finally:
            self.engine.close_stream(request_id)
        if isinstance(first, RequestAborted):
            raise PrefillError("CANCELLED", str(first))
        if isinstance(first, StreamEnd):
            raise PrefillError("INTERNAL", str(first))

        num_cached = request.num_prompt_cached_tokens
        # the first token is out, so the request was scheduled (the engine thread set this before it)
        scheduled_at = request.first_scheduled_at if request.first_scheduled_at is not None else first_at
        timings = PrefillTimings(queue_seconds=scheduled_at - arrival, prefill_seconds=first_at - scheduled_at)
        if self.store is not None:  # every prompt token is computed now (pinned, or cached once freed)
            self.store.publish(prompt_token_ids, len(prompt_token_ids))
        finished = _finishes_request(first, params, request.num_tokens >= request.max_num_tokens)
        if finished is not None:
            await self.engine.call(lambda e: e.free_pinned(request_id))
            return PrefillResult(dataclasses.replace(first, finish_reason=finished), None, num_cached, timings)
        ticket_id = f"{self.node_id}:{request_id}:{uuid.uuid4().hex[:8]}"
        try:
            ticket = await self.engine.call(lambda e: self._lease(e, ticket_id, request_id))
        except asyncio.CancelledError:  # the lease is still made on the engine thread: undo it behind it
            await asyncio.shield(self.abort(request_id))
            raise
        return PrefillResult(dataclasses.replace(first, finish_reason=None, stop_reason=None), ticket,
                             num_cached, timings)

    def _lease(self, engine: LLMEngine, ticket_id: str, request_id: str) -> KVTicket:
        pinned = engine.pinned_blocks(request_id)
        if pinned is None:  # aborted between its first token and now: blocks already freed
            raise PrefillError("CANCELLED", f"request {request_id} was aborted")
        deadline = time.time() + self.lease_s
        ticket = self._make_ticket(ticket_id, pinned, deadline)
        with self._leases_lock:
            self._leases[ticket_id] = Lease(ticket_id, request_id, deadline)
        return ticket

    async def release(self, ticket_id: str, incarnation: int) -> bool:
        """Frees a ticket's blocks. False for an unknown ticket or one from another incarnation."""
        if incarnation != self.incarnation:
            return False
        return await self.engine.call(lambda e: self._drop(e, ticket_id))

    def _drop(self, engine: LLMEngine, ticket_id: str) -> bool:
        with self._leases_lock:
            lease = self._leases.pop(ticket_id, None)
        if lease is None:
            return False
        engine.free_pinned(lease.request_id)
        return True

    def extend(self, ticket_id: str, incarnation: int, seconds: float) -> float | None:
        """Moves a live lease's deadline to now + seconds (at most 10 minutes); None if it is not live. Runs on
        the caller's thread, without the engine (see _leases)."""
        if incarnation != self.incarnation:
            return None
        with self._leases_lock:
            lease = self._leases.get(ticket_id)
            if lease is None:
                return None
            lease.deadline = max(lease.deadline, time.time() + min(max(seconds, 0.0), 600.0))
            return lease.deadline

    async def abort(self, request_id: str) -> bool:
        def abort(engine: LLMEngine) -> bool:
            with self._leases_lock:
                for ticket_id, lease in list(self._leases.items()):
                    if lease.request_id == request_id:
                        del self._leases[ticket_id]
            return self.engine.abort(engine, request_id)

        return await self.engine.call(abort)

    def _expire_leases(self, engine: LLMEngine) -> None:
        now = time.time()
        with self._leases_lock:
            expired = [self._leases.pop(t) for t, lease in list(self._leases.items()) if lease.deadline < now]
        for lease in expired:
            logger.warning("lease of ticket %s expired: freeing its blocks", lease.ticket_id)
            engine.free_pinned(lease.request_id)
            self.num_leases_expired += 1


def _finishes_request(first: StepOutput, params: SamplingParams, at_context_limit: bool) -> FinishReason | None:
    """Whether the first token ends the whole request (P ran it with max_tokens=1, so LENGTH alone says
    nothing: only the user's own max_tokens=1 or the context limit make it final)."""
    if first.finish_reason == FinishReason.STOP:
        return FinishReason.STOP
    if params.max_tokens == 1 or at_context_limit:
        return FinishReason.LENGTH
    return None
