"""The phase-free scheduler: continuous batching under a token budget, chunked prefill, preemption by recompute.

It owns every request the engine holds and every status transition (the state diagram is at the top of
engine/request.py). A step is `schedule()` -> the runner executes it -> `update_from_output()`.

`schedule()` advances each scheduled request's `num_computed_tokens` at once, so the next step could be planned
while this one runs. Running requests go first (oldest first); if the pool runs dry, the newest running
request is preempted (its blocks freed, to be recomputed later) until the older one fits. Waiting requests are
admitted while budget, seats and blocks last, taking what the prefix cache already holds. A prompt longer than
the budget is prefilled over several steps. `update_from_output()` appends the sampled tokens, registers the
newly computed full blocks in the prefix cache (only once their K/V is written) and finishes requests.

Asynchronous scheduling (engine/llm_engine.py) calls `schedule()` for step N+1 before `update_from_output()`
of step N: a step that samples leaves its request a pending token (engine/request.py), which the next step
takes as input from the device. So a request that step N finishes may run in step N+1 too (its blocks are
still allocated, its extra token is discarded), except that a request whose pending tokens already reach
max_tokens or the context is not scheduled again: that stop needs no token id.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.cache.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampler import SampledToken
from engine.types import FinishReason, StepOutput


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    start: int  # tokens [start, start + num_new_tokens) run this step
    num_new_tokens: int
    samples: bool  # the step reaches the end of the known tokens, so its logits give the next token
    # the request's tokens sampled by earlier steps whose ids the host had not read when this step was
    # scheduled: they count as output (noise index, min_tokens), and the step's input may be one of them
    num_pending_before: int = 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class ReservedBlocks(NamedTuple):
    """Blocks reserved for a prompt whose K/V comes from elsewhere, in token order."""

    block_ids: list[int]
    num_cached_blocks: int  # leading blocks already holding the prompt's K/V (this engine's prefix hits)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.requests: dict[str, Request] = {}  # unfinished ones and FINISHED_PINNED ones, by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ---- requests in ----
    def add(self, request: Request) -> None:
        """Queues a new request (WAITING)."""
        self._own(request)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def reserve_remote_kv(self, request: Request) -> ReservedBlocks | None:
        """Gives a new request blocks for its whole prompt, reusing this engine's prefix cache, to be filled
        from elsewhere (WAITING_FOR_REMOTE_KV). None, changing nothing, when the pool cannot hold it now."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        cached = self.kv.find_cached_prefix(request)
        if not self.kv.allocate(request, request.num_prompt_tokens - len(cached) * self.kv.block_size, cached):
            return None
        self.kv.record_lookup(request.num_prompt_tokens, len(cached) * self.kv.block_size)
        request.num_prompt_cached_tokens = len(cached) * self.kv.block_size
        request.num_computed_tokens = 0  # nothing counts as computed until the K/V has arrived
        self._own(request)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        return ReservedBlocks(list(request.block_ids), len(cached))

    def admit_remote_kv(self, request_id: str, first_token: SampledToken) -> StepOutput:
        """The prompt's K/V has arrived in the reserved blocks, with the first token sampled elsewhere: the
        request joins the batch like any other (num_computed_tokens = len(prompt), one token to go), unless
        that token already finishes it."""
        request = self.requests.get(request_id)
        if request is None or request.status is not RequestStatus.WAITING_FOR_REMOTE_KV:
            raise ValueError(f"request {request_id} is not waiting for its K/V (aborted meanwhile?)")
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv.cache_computed_blocks(request)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        return self._append(request, first_token)

    def _own(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request

    # ---- requests out: the two ways besides finishing ----
    def abort(self, request_id: str) -> bool:
        """Ends a request in any state, pinned ones included; its blocks go back. Whether it was here."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, FinishReason.ABORT)
        return True

    def free_pinned(self, request_id: str) -> bool:
        """Frees the blocks of a FINISHED_PINNED request and forgets it. False if it is not pinned here."""
        request = self.requests.get(request_id)
        if request is None or request.status is not RequestStatus.FINISHED_PINNED:
            return False
        assert request.finish_reason is not None
        request.status = RequestStatus.finished(request.finish_reason)
        self._release(request)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step ----
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.pending_tokens_reach_length_limit:
                index += 1  # its pending token finishes it: it keeps its seat and blocks until then
                continue
            num_new = min(request.num_tokens_with_pending - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, num_new, out):
                break  # the request preempted itself: nothing older is left to schedule
            self._schedule(request, num_new, out)
            budget -= num_new
            index += 1
        # While anything was preempted, admitting new work would only steal the blocks back.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            request = self.waiting[0]
            # a request that arrives with computed tokens (a decode node's pulled prompt) needs no lookup
            looked_up = request.num_computed_tokens == 0
            cached = self.kv.find_cached_prefix(request) if looked_up else []
            num_computed = request.num_computed_tokens + len(cached) * self.kv.block_size
            num_new = min(request.num_tokens_with_pending - num_computed, budget)
            if not self.kv.allocate(request, num_new, cached):
                break
            if looked_up:
                self.kv.record_lookup(request.num_tokens, len(cached) * self.kv.block_size)
            if request.status is RequestStatus.WAITING and cached:
                request.num_prompt_cached_tokens = len(cached) * self.kv.block_size
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._schedule(request, num_new, out)
            budget -= num_new
        return out

    @staticmethod
    def _schedule(request: Request, num_new: int, out: SchedulerOutput) -> None:
        start = request.num_computed_tokens
        request.num_computed_tokens += num_new
        samples = request.num_computed_tokens == request.num_tokens_with_pending
        out.scheduled.append(ScheduledRequest(request, start, num_new, samples, request.num_pending_tokens))
        if samples:
            request.num_pending_tokens += 1  # until update_from_output reads it

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate(request, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, SampledToken]) -> list[StepOutput]:
        """Records what the executed step produced: full blocks enter the prefix cache, sampled tokens are
        appended and may finish their requests."""
        outputs = []
        for item in out.scheduled:
            request = item.request
            if item.samples:
                request.num_pending_tokens -= 1
            if request.status.is_finished:
                continue  # aborted while the step ran, or finished by the step before (asynchronous scheduling)
            if request.status is RequestStatus.RUNNING:
                # only the K/V this step wrote: a later step may be scheduled (and run) already
                self.kv.cache_computed_blocks(request, item.start + item.num_new_tokens)
            # else: preempted by the next step's scheduling while this one ran; its token still counts
            token = sampled.get(request.request_id)
            if token is not None:
                outputs.append(self._append(request, token))
        return outputs

    def _append(self, request: Request, token: SampledToken) -> StepOutput:
        reason = request.append_token(token.token_id)
        if reason is not None:
            self._finish(request, reason)
        return StepOutput(request.request_id, token.token_id, token.logprobs, reason, request.stop_token_id)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.FINISHED_PINNED:  # only abort() gets here: it frees the blocks
            request.status = RequestStatus.FINISHED_ABORTED
            self._release(request)
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        request.finish_reason = reason
        if request.pin_blocks and reason is not FinishReason.ABORT:
            request.status = RequestStatus.FINISHED_PINNED
            return
        request.status = RequestStatus.finished(reason)
        self._release(request)

    def _release(self, request: Request) -> None:
        self.kv.free(request)
        del self.requests[request.request_id]
