"""The phase-free scheduler: continuous batching under a token budget, chunked prefill, preemption by recompute.

Each step, every scheduled request advances `num_computed_tokens` by its `num_new_tokens`. Running requests
go first (oldest first); if the pool runs dry, the newest running request is preempted (its blocks freed, to be
recomputed later) until the older one fits. Waiting requests are admitted while budget, seats and blocks last,
taking what the prefix cache already holds. A prompt longer than the budget is prefilled over several steps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.cache.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens [num_computed_tokens, num_computed_tokens + num_new_tokens) run this step

    @property
    def samples(self) -> bool:
        """The step reaches the end of the known tokens, so its logits give the next token."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


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


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        """Queues a request. One whose num_computed_tokens > 0 already owns blocks holding those tokens'
        K/V (a decode node's pulled prompt); it skips the prefix-cache lookup and continues from there."""
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if self._allocate_or_preempt(request, num_new, out):
                out.scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                index += 1
            else:
                break  # the request preempted itself: nothing older is left to schedule
        # While anything was preempted, admitting new work would only steal the blocks back.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            request = self.waiting[0]
            # a request that arrives with computed tokens (a decode node's pulled prompt) needs no lookup
            looked_up = request.num_computed_tokens == 0
            cached = self.kv.find_cached_prefix(request) if looked_up else []
            num_computed = request.num_computed_tokens + len(cached) * self.kv.block_size
            num_new = min(request.num_tokens - num_computed, budget)
            if not self.kv.allocate(request, num_new, cached):
                break
            if looked_up:
                self.kv.record_lookup(request.num_tokens, len(cached) * self.kv.block_size)
            if request.status == RequestStatus.WAITING and cached:
                request.num_prompt_cached_tokens = len(cached) * self.kv.block_size
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return out

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

    def advance(self, out: SchedulerOutput) -> None:
        """Records that the step ran: computed tokens move forward and full blocks enter the prefix cache."""
        for item in out.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
            self.kv.cache_computed_blocks(item.request)

    def finish(self, request: Request, free_blocks: bool = True) -> None:
        """Takes a request out (finished or aborted) and, unless told to keep them, gives its blocks back."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        if free_blocks:
            self.kv.free(request)
