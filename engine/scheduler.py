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

Speculative decoding (engine/spec_decode/, synchronous scheduling only): a running request with one token to
compute is scheduled with the proposer's drafts after it, `num_computed_tokens` counting them. The step samples
at every one of those positions; `update_from_output()` keeps the drafts the samples confirm, appends them and
the sample after them (each its own StepOutput, stopping at the first that finishes the request) and takes
`num_computed_tokens` back over the rejected drafts, whose blocks stay allocated for the tokens to come.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.cache.kv_cache_manager import NO_HIT, KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampler import SampledToken
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.verify import SpecDecodeStats, num_accepted_drafts
from engine.types import FinishReason, PositionLogprobs, StepOutput


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    start: int  # tokens [start, start + num_new_tokens) run this step
    num_new_tokens: int
    samples: bool  # the step reaches the end of the known tokens, so its logits give the next token
    # the request's tokens sampled by earlier steps whose ids the host had not read when this step was
    # scheduled: they count as output (noise index, min_tokens), and the step's input may be one of them
    num_pending_before: int = 0
    # speculative tokens after the request's known ones, the last num_new_tokens - 1 of the step's inputs; the
    # step samples at each of them too, so a request with drafts has 1 + len(draft_token_ids) samples
    draft_token_ids: tuple[int, ...] = ()


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
    # leading blocks already holding the prompt's K/V (this engine's prefix hits; those from its host tier once the
    # engine has run its planned copies)
    num_cached_blocks: int


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 proposer: NgramProposer | None = None) -> None:
        self.kv = kv
        self.proposer = proposer  # None: no speculative decoding
        self.spec_stats = SpecDecodeStats()
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
        request.prompt_logprobs = None  # they come with the K/V, from the node that prefilled the prompt
        hit = self.kv.find_cached_prefix(request)
        num_hit_tokens = hit.num_blocks * self.kv.block_size
        if not self.kv.allocate(request, request.num_prompt_tokens - num_hit_tokens, hit):
            return None
        self.kv.record_lookup(request.num_prompt_tokens, hit)
        request.num_prompt_cached_tokens = num_hit_tokens
        request.num_computed_tokens = 0  # nothing counts as computed until the K/V has arrived
        self._own(request)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        return ReservedBlocks(list(request.block_ids), hit.num_blocks)

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
            drafts = self._drafts(request, num_new, budget)
            # drafts are worth no preemption: without blocks for them the request decodes one token
            if drafts and self.kv.allocate(request, num_new + len(drafts)):
                num_new += len(drafts)
            else:
                drafts = ()
                if not self._allocate_or_preempt(request, num_new, out):
                    break  # the request preempted itself: nothing older is left to schedule
            self._schedule(request, num_new, out, drafts)
            budget -= num_new
            index += 1
        # While anything was preempted, admitting new work would only steal the blocks back.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            request = self.waiting[0]
            # a request that arrives with computed tokens (a decode node's pulled prompt) needs no lookup, and one
            # that still needs its prompt logprobs takes no hits (engine/prompt_logprobs.py)
            looked_up = request.num_computed_tokens == 0 and request.reads_prefix_cache
            hit = self.kv.find_cached_prefix(request) if looked_up else NO_HIT
            num_computed = request.num_computed_tokens + hit.num_blocks * self.kv.block_size
            num_new = min(request.num_tokens_with_pending - num_computed, budget)
            if not self.kv.allocate(request, num_new, hit):
                break
            if looked_up:
                self.kv.record_lookup(request.num_tokens, hit)
            if request.status is RequestStatus.WAITING and hit.num_blocks:
                request.num_prompt_cached_tokens = hit.num_blocks * self.kv.block_size
            self.waiting.popleft()
            if request.first_scheduled_at is None:
                request.first_scheduled_at = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._schedule(request, num_new, out)
            budget -= num_new
        return out

    def _drafts(self, request: Request, num_new: int, budget: int) -> tuple[int, ...]:
        """Drafts to verify after the request's one token to compute; none for a prefill chunk, a request whose
        last token is still on the device, or one that the drafts could not extend (budget, max_tokens, context:
        a step appends at most 1 + len(drafts) tokens), or a constrained one (structured output: its grammar would
        need a state per draft position, which the sampler's one mask per request does not have)."""
        if self.proposer is None or num_new != 1 or request.num_pending_tokens or request.grammar is not None:
            return ()
        room = min(budget, request.max_num_tokens - request.num_tokens) - 1
        max_tokens = request.params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return tuple(self.proposer.propose(request.token_ids, room)) if room > 0 else ()

    @staticmethod
    def _schedule(request: Request, num_new: int, out: SchedulerOutput, drafts: tuple[int, ...] = ()) -> None:
        start = request.num_computed_tokens
        request.num_computed_tokens += num_new
        samples = request.num_computed_tokens - len(drafts) == request.num_tokens_with_pending
        out.scheduled.append(ScheduledRequest(request, start, num_new, samples, request.num_pending_tokens,
                                              drafts))
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

    def update_from_output(self, out: SchedulerOutput, sampled: Mapping[str, Sequence[SampledToken]],
                           prompt_logprobs: Mapping[str, tuple[int, list[PositionLogprobs]]] | None = None
                           ) -> list[StepOutput]:
        """Records what the executed step produced: full blocks enter the prefix cache, sampled tokens are
        appended and may finish their requests. `sampled` holds each sampling request's tokens in position order:
        one, or 1 + its drafts for a request with drafts. `prompt_logprobs`: request id -> (first position, the
        logprobs of the prompt positions from there) that the step computed (engine/prompt_logprobs.py)."""
        outputs = []
        for item in out.scheduled:
            request = item.request
            if item.samples:
                request.num_pending_tokens -= 1
            if request.status.is_finished:
                continue  # aborted while the step ran, or finished by the step before (asynchronous scheduling)
            if prompt_logprobs and request.request_id in prompt_logprobs:
                request.add_prompt_logprobs(*prompt_logprobs[request.request_id])
            if item.draft_token_ids:
                outputs += self._verify(item, sampled[request.request_id])
                continue
            if request.status is RequestStatus.RUNNING:
                # only the K/V this step wrote: a later step may be scheduled (and run) already
                self.kv.cache_computed_blocks(request, item.start + item.num_new_tokens)
            # else: preempted by the next step's scheduling while this one ran; its token still counts
            tokens = sampled.get(request.request_id)
            if tokens:
                outputs.append(self._append(request, tokens[0]))
        return outputs

    def _verify(self, item: ScheduledRequest, tokens: Sequence[SampledToken]) -> list[StepOutput]:
        """Keeps the drafts the samples confirm and the sample after them (engine/spec_decode/verify.py)."""
        request, drafts = item.request, item.draft_token_ids
        num_accepted = num_accepted_drafts(drafts, [token.token_id for token in tokens])
        self.spec_stats.observe(len(drafts), num_accepted)
        # the rejected drafts' K/V is not the request's: later steps overwrite it (their blocks stay allocated)
        request.num_computed_tokens -= len(drafts) - num_accepted
        if request.status is RequestStatus.RUNNING:
            # the known token's K/V only: the accepted drafts' blocks are registered by the next step's update,
            # once they are among the request's tokens (blocks are hashed from token ids)
            self.kv.cache_computed_blocks(request, item.start + 1)
        outputs = []
        for token in tokens[:num_accepted + 1]:
            outputs.append(self._append(request, token))
            if outputs[-1].finished:
                break  # an EOS, stop token or length limit among the kept tokens ends the request there
        return outputs

    def _append(self, request: Request, token: SampledToken) -> StepOutput:
        reason = request.append_token(token.token_id)
        if reason is not None:
            self._finish(request, reason)
        return StepOutput(request.request_id, token.token_id, token.logprobs, reason, request.stop_token_id,
                          request.take_prompt_logprobs())

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
