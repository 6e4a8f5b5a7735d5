"""The decode node's request lifecycle, around the engine thread. No gRPC here (service.py is the edge).

A request's life on a decode node (D):
1. `Generate` arrives with a KV ticket and the first token. The ticket must match this node's KV layout.
2. D asks the prefill node (P) to extend the ticket's lease: a ticket that is not live there (released,
   expired, or from an earlier incarnation of P) is refused at once, so D never reads stale blocks.
3. D reserves blocks for the prompt, reusing its own prefix-cache hits (the request is
   WAITING_FOR_REMOTE_KV in the engine: see engine/request.py); when the pool is full it waits, extending
   the lease, until blocks free up or the deadline passes.
4. D pulls the blocks it lacks with one READ (runs of consecutive ids become single descriptors; on a node of
   several tensor-parallel ranks, one per rank and prefill rank it reads heads from), polled
   from the engine thread, and verifies each pulled block's checksum (in one batch, with the algorithm P's
   checksums name: a ticket naming one D does not know is refused before the pull). A failed or corrupt
   transfer aborts the request (freeing the blocks) with a retryable error: never a success with wrong KV.
5. D releases the ticket on P and admits the request (`admit_remote_kv`: num_computed_tokens = len(prompt),
   the first token appended, and fed to the request's grammar when it has structured output, so that D masks
   the second token as P's engine would have): from here it is batched like any other request, and its tokens
   stream back.
6. A client that goes away, or a deadline that passes, aborts the request and frees its blocks.

Timings (wire.DecodeTimings, on the first output of a request with a ticket): handoff is the RPC's arrival (step 1)
to the admission (step 5), first step the admission to the first token out of the engine.

A `Generate` without a ticket is a colocated request (the proxy judged prefilling here cheaper than a
transfer, e.g. a short prompt or one mostly in D's prefix cache): D adds it to its engine like any request,
prefills it (with its own prefix-cache hits) and streams every token, the first one included (with the prompt's
logprobs when asked: the engine then takes no prefix-cache hits for it). A request with a ticket has its prompt
logprobs from P: D computes none. With `output_token_ids` it continues a request that generated them elsewhere
(the proxy migrates a request whose decode node was lost mid-stream): D computes prompt + those tokens and
streams only the ones after them, which are those of the uninterrupted request (the tokens count as output:
max_tokens, min_tokens, penalties, seeds).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from decode_node.leases import LeaseCheck, LeaseClient
from engine.async_engine import AsyncEngine, RequestAborted, StreamEnd
from engine.llm_engine import LLMEngine
from engine.request import Request
from engine.sampler import SampledToken
from engine.scheduler import ReservedBlocks
from engine.types import FinishReason, PositionLogprobs, PromptLogprobs, SamplingParams, StepOutput
from kvtransfer import InvalidRequestError, KVRegion, TransferError, TransferStatus
from kvtransfer.base import Connector, TransferHandle
from kvtransfer.checksum import checksum_algorithm, mismatched_blocks
from node_common.store_tier import StoreTier
from wire import DecodeTimings, KVTicket

logger = logging.getLogger(__name__)
_Reserved = tuple[Request, ReservedBlocks | None, TransferHandle | None]  # a request, its blocks, its read

POLL_INTERVAL_S = 0.0005
LEASE_EXTENSION_S = 15.0


class DecodeError(Exception):
    """A request D cannot serve; `code` names the gRPC status, `retryable` tells the proxy to re-prefill."""

    def __init__(self, code: str, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.retryable = retryable


@dataclass(frozen=True)
class DecodeOutput:
    token_ids: list[int]
    logprobs: list[PositionLogprobs]
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    num_cached_tokens: int | None = None  # a colocated request's prefix hit here, on its first output
    prompt_logprobs: PromptLogprobs | None = None  # a colocated request's, when asked, on its first output
    timings: DecodeTimings | None = None  # a request with a ticket's, on its first output


class DecodeLoop:
    def __init__(self, engine: AsyncEngine, connector: Connector, region: KVRegion, layout_hash: str,
                 leases: LeaseClient, verify: Callable[[list[int], tuple[str, ...]], list[int]] | None = None,
                 store: StoreTier | None = None) -> None:
        """verify(block ids, expected checksums) -> the mismatched blocks, on the engine thread (default: the
        checksums of `region`'s blocks; a node split over tensor-parallel ranks checks every rank's slice).
        With a cluster KV `store`, a finished request's prompt and answer blocks are put in it (the next turn's
        prefill finds them there), and a colocated prompt's blocks are got from it first."""
        self.engine = engine
        self.store = store
        self.connector = connector
        self.region = region
        self._verify_blocks = verify
        self.layout_hash = layout_hash
        self.leases = leases
        self.num_transfer_failures = 0
        self.num_transferred_bytes = 0
        self.num_transfers = 0
        self.transfer_seconds = 0.0
        self._background: set[asyncio.Future[bool]] = set()  # release calls in flight (kept referenced)
        # On the engine thread: the requests whose read is in flight, and those of them aborted meanwhile (their
        # blocks go back once the read is over: the transfer path frees them, see `abort`)
        self._reading: set[str] = set()
        self._aborted_while_reading: set[str] = set()

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       ticket: KVTicket, first_token: int, first_logprobs: PositionLogprobs | None,
                       deadline: float | None) -> AsyncGenerator[DecodeOutput, None]:
        arrival = time.monotonic()
        if ticket.layout_hash != self.layout_hash:
            raise DecodeError("FAILED_PRECONDITION", f"ticket {ticket.ticket_id} has KV layout {ticket.layout_hash}, "
                                                     f"this node {self.layout_hash}: the prefill node's blocks "
                                                     "differ in model, --dtype, --kv-cache-dtype, --block-size, "
                                                     "--hash-seed or TP size")
        # The lease is confirmed on P while D reserves and pulls (the round trip is off the second token's path):
        # blocks pulled under a ticket that turns out not to be live are thrown away with the request, never
        # admitted (their checksums would not match either).
        try:  # a constrained request's grammar compiles off the engine thread (engine/async_engine.py)
            await self.engine.compile_structured_output(params)
        except ValueError as e:
            raise DecodeError("INVALID_ARGUMENT", str(e)) from e
        lease = LeaseCheck(asyncio.ensure_future(self.leases.extend(ticket, LEASE_EXTENSION_S)))
        events = self.engine.open_stream(request_id)
        try:
            first = SampledToken(first_token, first_logprobs)
            try:
                request, admitted = await self._transfer(request_id, prompt_token_ids, params, ticket, first,
                                                         lease, deadline)
            except BaseException as e:
                await asyncio.shield(self.engine.call(lambda eng: eng.abort(request_id)))
                if not isinstance(e, asyncio.CancelledError) and not await lease.live():
                    raise _not_live_error(ticket) from e
                raise
            # P frees the blocks in the background: the second token need not wait for that round trip
            release = asyncio.ensure_future(self.leases.release(ticket))
            self._background.add(release)
            release.add_done_callback(self._background.discard)
            admitted_at = time.monotonic()
            if admitted.finished:
                yield DecodeOutput([], [], admitted.finish_reason, admitted.stop_reason,
                                   timings=DecodeTimings(admitted_at - arrival, 0.0))
                return
            timings: DecodeTimings | None = None
            async for out in self._stream(request, events, deadline):
                if timings is None:
                    timings = DecodeTimings(admitted_at - arrival, time.monotonic() - admitted_at)
                    out = dataclasses.replace(out, timings=timings)
                yield out
        finally:
            lease.future.cancel()  # a no-op once answered
            await self._forget(request_id)

    async def generate_local(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                             deadline: float | None, output_token_ids: Sequence[int] = ()
                             ) -> AsyncGenerator[DecodeOutput, None]:
        """A colocated request: prefilled here, every token streamed (the first output carries the prefix hit).
        With `output_token_ids`, a continuation: the tokens after them."""
        try:
            await self.engine.compile_structured_output(params)
        except ValueError as e:
            raise DecodeError("INVALID_ARGUMENT", str(e)) from e
        staged = await self.store.fetch(prompt_token_ids) if self.store is not None else []
        events = self.engine.open_stream(request_id)
        try:
            def add(e: LLMEngine) -> Request:
                if self.store is not None:
                    self.store.stage(e, staged)
                return e.add_request(request_id, prompt_token_ids, params, output_token_ids=output_token_ids)

            try:
                request = await self.engine.call(add)
            except ValueError as e:
                raise DecodeError("INVALID_ARGUMENT", str(e)) from e
            first = True
            async for out in self._stream(request, events, deadline):
                if first:  # set when the request was first scheduled, before its first token was sampled
                    out = dataclasses.replace(out, num_cached_tokens=request.num_prompt_cached_tokens)
                    first = False
                yield out
        finally:
            await self._forget(request_id)

    async def _stream(self, request: Request, events: asyncio.Queue[StepOutput | StreamEnd],
                      deadline: float | None) -> AsyncGenerator[DecodeOutput, None]:
        finished = False
        while not finished:
            try:
                # a token already there is taken without a wait; else a deadline's timer (wait_for would make a
                # task and a timer for every token)
                event = events.get_nowait() if not events.empty() else await _get(events, deadline)
            except TimeoutError as e:
                raise DecodeError("DEADLINE_EXCEEDED", f"request {request.request_id} passed its deadline") from e
            if isinstance(event, RequestAborted):
                raise DecodeError("CANCELLED", str(event))
            if isinstance(event, StreamEnd):
                raise DecodeError("INTERNAL", str(event))
            finished = event.finished
            if finished and self.store is not None:  # final now: the engine no longer touches the request
                token_ids = list(request.token_ids)
                self.store.publish(token_ids, len(token_ids) - 1)  # the last token's K/V is never computed
            yield DecodeOutput([event.token_id], [event.logprobs] if event.logprobs else [], event.finish_reason,
                               event.stop_reason, prompt_logprobs=event.prompt_logprobs)

    async def _forget(self, request_id: str) -> None:
        self.engine.close_stream(request_id)
        # aborting a finished request only forgets it; an unfinished one (client gone) frees its blocks
        def forget(engine: LLMEngine) -> None:
            self._aborted_while_reading.discard(request_id)
            self._reading.discard(request_id)  # (a read that raised at poll is over: its connector failed it)
            engine.abort(request_id)

        await asyncio.shield(self.engine.call(forget))

    async def _transfer(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                        ticket: KVTicket, first: SampledToken, lease: LeaseCheck, deadline: float | None
                        ) -> tuple[Request, StepOutput]:
        """Reserves blocks, pulls and verifies the ticket's blocks and admits the request, in as few hops to
        the engine thread as it takes (each waits for a running step): reserve + read in one, then polls, the
        one that sees DONE verifying and, when the lease is confirmed by then, admitting too."""
        started = time.perf_counter()
        request, blocks, handle = await self._reserve_and_read(request_id, prompt_token_ids, params, ticket,
                                                               first.token_id, deadline)
        local = blocks.block_ids[blocks.num_cached_blocks:]
        expected = ticket.block_checksums[blocks.num_cached_blocks:]
        read_at = time.perf_counter()
        stop: list[DecodeError] = []  # set: the request ends as soon as the read is over (until then it writes)

        def check(engine: LLMEngine) -> tuple[TransferStatus, list[int], StepOutput | None]:
            status = TransferStatus.DONE if handle is None else self.connector.poll(handle)
            if status is not TransferStatus.PENDING:
                self._reading.discard(request_id)
            if status is not TransferStatus.DONE:
                return status, [], None
            bad = self._verify(local, expected) if local else []
            admit = not bad and lease.confirmed and not stop and request_id not in self._aborted_while_reading
            return status, bad, engine.admit_remote_kv(request_id, first) if admit else None

        try:
            while True:
                status, bad, admitted = await self.engine.call(check)
                if status is not TransferStatus.PENDING:
                    break
                if not stop and lease.answered_not_live:
                    stop.append(_not_live_error(ticket))
                    # P restarted, died or dropped the ticket: its reads are doomed. Removing the peer gives them
                    # up (each ends FAILED once nothing more can land in its blocks; it is added again by the next
                    # ticket that names it).
                    await self.engine.call(lambda _: self._remove_peer(handle))
                if not stop and deadline is not None and time.time() >= deadline:
                    stop.append(DecodeError("DEADLINE_EXCEEDED", "the KV transfer outlasted the request's deadline"))
                if not stop and request_id in self._aborted_while_reading:
                    stop.append(DecodeError("CANCELLED", f"request {request_id} was aborted"))
                await asyncio.sleep(POLL_INTERVAL_S)
        except TransferError as e:
            self.num_transfer_failures += 1
            raise DecodeError("ABORTED", f"KV transfer failed: {e}", retryable=True) from e
        except ValueError as e:  # admit_remote_kv: the request was aborted meanwhile
            raise DecodeError("CANCELLED", str(e)) from e
        except BaseException:  # cancelled (the client went away): the blocks go back only once nothing lands
            if handle is not None:
                logger.debug("request %s: cancelled with its KV read in flight: waiting for it to end", request_id)
                await _through_cancellation(self._drain(request_id, handle))
                logger.debug("request %s: its cancelled read is over", request_id)
            raise
        if stop:
            logger.debug("request %s: read %s, then stopped: %s", request_id, status.name, stop[0])
            raise stop[0]
        if status is TransferStatus.FAILED:
            self.num_transfer_failures += 1
            reason = self.connector.failure_reason(handle) if handle is not None else None
            raise DecodeError("ABORTED", f"KV transfer failed: {reason}", retryable=True)
        if bad:
            self.num_transfer_failures += 1
            raise DecodeError("DATA_LOSS", f"KV checksum mismatch in {len(bad)} of {len(local)} pulled blocks of "
                                           f"ticket {ticket.ticket_id}", retryable=True)
        if handle is not None:
            self.num_transferred_bytes += handle.num_bytes
            self.num_transfers += 1
            self.transfer_seconds += time.perf_counter() - read_at
        pulled_at = time.perf_counter()
        admitted_in_poll = admitted is not None
        if admitted is None:  # the lease's answer came after the blocks
            if not await lease.live():
                raise _not_live_error(ticket)
            try:
                admitted = await self.engine.call(lambda e: e.admit_remote_kv(request_id, first))
            except ValueError as e:
                raise DecodeError("CANCELLED", str(e)) from e
        logger.debug("request %s: %d blocks; reserve+read %.2f ms, pull+verify %.2f ms, admitted at %.2f ms%s",
                     request_id, len(local), (read_at - started) * 1e3, (pulled_at - read_at) * 1e3,
                     (time.perf_counter() - started) * 1e3, "" if admitted_in_poll else " (after the lease)")
        return request, admitted

    async def _reserve_and_read(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                                ticket: KVTicket, first_token: int, deadline: float | None
                                ) -> tuple[Request, ReservedBlocks, TransferHandle | None]:
        """The request with blocks for its prompt and the READ of those it lacks started (None: it lacks none),
        waiting (and extending the lease) while the pool is full."""
        expected_blocks = -(-len(prompt_token_ids) // self.engine.engine.block_size)
        if ticket.num_tokens != len(prompt_token_ids) or len(ticket.block_ids) != expected_blocks:
            raise DecodeError("INVALID_ARGUMENT", f"ticket {ticket.ticket_id} covers {ticket.num_tokens} tokens in "
                                                  f"{len(ticket.block_ids)} blocks; the prompt has "
                                                  f"{len(prompt_token_ids)} tokens ({expected_blocks} blocks)")
        try:  # before the transfer: a ticket D cannot verify is not worth pulling
            for checksum in set(ticket.block_checksums):
                checksum_algorithm(checksum)
        except InvalidRequestError as e:
            raise DecodeError("INVALID_ARGUMENT", f"ticket {ticket.ticket_id} cannot be verified here: {e}") from e
        made: list[Request] = []

        def reserve_and_read(engine: LLMEngine) -> tuple[Request, ReservedBlocks | None, TransferHandle | None]:
            if not made:  # the request and its first token (in its grammar, if any) are checked before any pull
                request = engine.make_request(request_id, prompt_token_ids, params)
                engine.validate_first_token(request, first_token)
                made.append(request)
            blocks = engine.reserve_remote_kv(made[0])
            if blocks is None or blocks.num_cached_blocks == len(blocks.block_ids):
                return made[0], blocks, None
            peer = self.connector.add_peer(ticket.transfer_endpoint)
            skip = blocks.num_cached_blocks  # our own prefix hits need no transfer
            handle = self.connector.read(peer, ticket.block_ids[skip:], blocks.block_ids[skip:])
            self._reading.add(request_id)
            return made[0], blocks, handle

        last_extension = time.monotonic()
        while True:
            try:
                request, blocks, handle = await self._start_read(reserve_and_read)
            except ValueError as e:
                raise DecodeError("INVALID_ARGUMENT", str(e)) from e
            except TransferError as e:
                self.num_transfer_failures += 1
                raise DecodeError("ABORTED", f"KV transfer failed: {e}", retryable=True) from e
            if blocks is not None:
                return request, blocks, handle
            if deadline is not None and time.time() >= deadline:
                raise DecodeError("RESOURCE_EXHAUSTED", "no free KV blocks before the deadline", retryable=True)
            if time.monotonic() - last_extension > LEASE_EXTENSION_S / 3:
                if not await self.leases.extend(ticket, LEASE_EXTENSION_S):
                    raise DecodeError("FAILED_PRECONDITION", f"ticket {ticket.ticket_id} expired while waiting "
                                                             "for KV blocks", retryable=True)
                last_extension = time.monotonic()
            await asyncio.sleep(0.01)

    async def _start_read(self, reserve_and_read: Callable[[LLMEngine], _Reserved]) -> _Reserved:
        """Runs `reserve_and_read` on the engine thread. Cancelled meanwhile (the proxy gave the attempt up), it runs
        all the same: a read it started is waited for before the cancellation goes on, since what follows it
        frees the request's blocks (and bytes landing in freed blocks corrupt the next request's KV)."""
        call = asyncio.ensure_future(self.engine.call(reserve_and_read))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            await _through_cancellation(self._drain_started(call))
            raise

    async def _drain_started(self, call: asyncio.Future[_Reserved]) -> None:
        try:
            request, _, handle = await call
        except Exception:  # noqa: BLE001 - it raised, so it started no read
            return
        if handle is not None:
            await self._drain(request.request_id, handle)

    def _remove_peer(self, handle: TransferHandle | None) -> None:
        try:
            if handle is not None:
                self.connector.remove_peer(handle.peer)
        except TransferError as e:  # already removed (another request did it) or the connector is closed
            logger.debug("removing peer %s: %s", handle.peer if handle else None, e)

    async def _drain(self, request_id: str, handle: TransferHandle) -> None:
        """Waits until a read is over (DONE or FAILED: FAILED only once nothing more can land), so that blocks
        freed after it receive no more bytes."""
        def over(_: LLMEngine) -> bool:
            try:
                if self.connector.poll(handle) is TransferStatus.PENDING:
                    return False
            except TransferError:
                pass  # a closed connector has failed its reads, and its library is gone
            self._reading.discard(request_id)
            return True

        while not await self.engine.call(over):
            await asyncio.sleep(POLL_INTERVAL_S)

    def _verify(self, local: list[int], expected: tuple[str, ...]) -> list[int]:
        # KVTicket guarantees one checksum per block (a ticket without them never gets this far); each block is
        # checked with the algorithm P named (mix64 from a GPU node, xxh3 from a CPU node), in one batch
        if self._verify_blocks is not None:
            return self._verify_blocks(local, expected)
        return mismatched_blocks(self.region, local, expected)

    async def abort(self, request_id: str) -> bool:
        """Aborts a request (the proxy gave it up). One whose KV read is in flight keeps its blocks until the read
        is over, since no transport can stop a read and its bytes would land in blocks given to other requests:
        its transfer ends CANCELLED then, and frees them."""
        def abort_now(engine: LLMEngine) -> bool:
            if request_id in self._reading:
                logger.debug("request %s: aborted with its KV read in flight: its blocks go back once it is over",
                             request_id)
                self._aborted_while_reading.add(request_id)
                return True
            return self.engine.abort(engine, request_id)

        return await self.engine.call(abort_now)



def _not_live_error(ticket: KVTicket) -> DecodeError:
    return DecodeError("FAILED_PRECONDITION", f"ticket {ticket.ticket_id} is not live on its prefill node "
                                              "(released, expired, or the node restarted)", retryable=True)


async def _through_cancellation(work: Awaitable[None]) -> None:
    """Awaits `work` to its end even when cancelled again meanwhile (an RPC is cancelled, then its request aborted),
    then raises CancelledError if it was: what follows frees blocks that `work` must see unused first."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    task.result()
    if cancelled:
        raise asyncio.CancelledError


async def _get(events: asyncio.Queue[StepOutput | StreamEnd], deadline: float | None) -> StepOutput | StreamEnd:
    """The stream's next event; TimeoutError once the deadline (a time.time()) passes."""
    if deadline is None:
        return await events.get()
    async with asyncio.timeout(max(0.0, deadline - time.time())):
        return await events.get()
