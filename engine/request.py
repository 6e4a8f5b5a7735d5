"""One request's state, all in one place. The scheduler owns every status transition (engine/scheduler.py).

The states, and who moves a request between them:

    WAITING ----------------> RUNNING ----------------> FINISHED_STOPPED / FINISHED_LENGTH
       ^   schedule()          |    update_from_output()         (or FINISHED_PINNED with pin_blocks)
       |                       v
       +--- PREEMPTED <--- schedule() when the pool runs dry (blocks freed, recomputed later)

    WAITING_FOR_REMOTE_KV --admit_remote_kv()--> WAITING (prompt computed elsewhere, first token appended)

    any unfinished state or FINISHED_PINNED --abort()--> FINISHED_ABORTED (blocks freed)
    FINISHED_PINNED --free_pinned()--> gone (blocks freed)

A prefill node pins a finished request's blocks (FINISHED_PINNED) until a decode node has pulled them; a
decode node reserves blocks for a prompt whose K/V it pulls (WAITING_FOR_REMOTE_KV). Both still belong to
the scheduler, so `abort()` frees them like any other request.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.hashing import BlockHash
from engine.types import FinishReason, PositionLogprobs, PromptLogprobs, SamplingParams

if TYPE_CHECKING:  # xgrammar (and torch) only where a request is constrained
    from engine.structured_output import Grammar

logger = logging.getLogger(__name__)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # blocks reserved; their K/V arrives from another node
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks given back; recomputes its tokens when scheduled again
    FINISHED_PINNED = "finished_pinned"  # done, but its blocks are kept until free_pinned() or abort()
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop token id
    FINISHED_LENGTH = "finished_length"  # max_tokens or the context limit
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @staticmethod
    def finished(reason: FinishReason) -> RequestStatus:
        return {FinishReason.STOP: RequestStatus.FINISHED_STOPPED, FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
                FinishReason.ABORT: RequestStatus.FINISHED_ABORTED}[reason]


_FINISHED = frozenset({RequestStatus.FINISHED_PINNED, RequestStatus.FINISHED_STOPPED,
                       RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED})


@dataclass(eq=False)
class Request:
    """A sequence being generated. Phase-free: `num_computed_tokens` just catches up with `token_ids`.

    token_ids = prompt + output. `num_computed_tokens` counts the tokens whose K/V is computed or being
    computed by the step in flight: the scheduler advances it when it schedules a step, so the next step
    can be planned while this one runs. Once it reaches num_tokens, the step's logits give the next token.

    With asynchronous scheduling a sampled token reaches the host one step after it was sampled: until then
    it is pending, counted by `num_pending_tokens` but not in `token_ids`, and the next step takes it as input
    straight from the device. The scheduler plans with `num_tokens_with_pending`.

        token_ids:  |<------------ prompt ------------>|<--- output --->|<- pending ->|
        K/V:        |<------- num_computed_tokens ------->|  (in block_ids)
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    # The seed of this request's sampling noise. The noise of output token k depends on (seed, k) only, so a
    # request continued on another node (P samples token 0, D the rest) samples what it would have here.
    seed: int = 0
    max_num_tokens: int = 0  # context limit: the request finishes with LENGTH when it has this many tokens
    pin_blocks: bool = False  # finish as FINISHED_PINNED: keep the K/V blocks until free_pinned()
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache
    num_prompt_cached_tokens: int = 0  # prefix-cache hit when first scheduled
    first_scheduled_at: float | None = None  # time.monotonic() of the schedule() that first took it (queue time)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None  # set when it finishes (a pinned request keeps it too)
    stop_token_id: int | None = None  # the stop token id that finished it (None for EOS or no stop token)
    # tokens that scheduled steps sample (or have sampled) whose ids the host has not read yet: one per step
    # scheduled and not yet processed, so at most two (the step in flight and the one being launched)
    num_pending_tokens: int = 0
    # params.structured_outputs' matcher, advanced by every appended token (the engine makes it)
    grammar: Grammar | None = None
    # params.prompt_logprobs' results so far, [None, position 1, ...] (engine/prompt_logprobs.py), until they are
    # handed out with the first output; None when not asked, once handed out, or computed elsewhere (a pulled
    # prompt's come from the node that prefilled it)
    prompt_logprobs: PromptLogprobs | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def reads_prefix_cache(self) -> bool:
        """False while prompt logprobs are still to compute: positions served from the prefix cache have no
        logits (vLLM skips the cache for such requests too)."""
        return self.prompt_logprobs is None

    def add_prompt_logprobs(self, first_position: int, positions: list[PositionLogprobs]) -> None:
        """Records a prefill chunk's prompt logprobs, those of positions first_position, first_position + 1, ...;
        positions already recorded (a chunk computed again after a preemption) are skipped."""
        recorded = self.prompt_logprobs
        if recorded is None:
            return
        assert first_position <= len(recorded), (
            f"request {self.request_id}: prompt logprobs from position {first_position}, {len(recorded)} recorded")
        recorded.extend(positions[len(recorded) - first_position:])

    def take_prompt_logprobs(self) -> PromptLogprobs | None:
        """The prompt logprobs, once, for the request's first output (None when not asked, or already taken)."""
        recorded, self.prompt_logprobs = self.prompt_logprobs, None
        assert recorded is None or len(recorded) == self.num_prompt_tokens, (
            f"request {self.request_id}: {len(recorded or [])} of {self.num_prompt_tokens} prompt logprobs")
        return recorded

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def pending_tokens_reach_length_limit(self) -> bool:
        """The pending tokens alone finish the request by length (max_tokens or the context): a further
        step would compute a token that is certainly discarded, possibly past the context."""
        max_tokens = self.params.max_tokens
        return self.num_pending_tokens > 0 and (
            self.num_tokens_with_pending >= self.max_num_tokens
            or (max_tokens is not None and self.num_tokens_with_pending - self.num_prompt_tokens >= max_tokens))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def append_token(self, token_id: int) -> FinishReason | None:
        """Appends a sampled token; returns why that finishes the request, or None to keep going.

        Token-level stops only (EOS, stop token ids, max_tokens, the context, the grammar's end): stop strings are
        text, and text is the output processor's (engine/output_processor.py)."""
        self.token_ids.append(token_id)
        params = self.params
        if self.grammar is not None and not self._advance_grammar(token_id):
            return FinishReason.STOP
        if self.num_output_tokens >= params.min_tokens and (
                token_id in self.eos_token_ids or token_id in (params.stop_token_ids or ())):
            self.stop_token_id = None if token_id in self.eos_token_ids else token_id
            return FinishReason.STOP
        if self.num_tokens >= self.max_num_tokens or (
                params.max_tokens is not None and self.num_output_tokens >= params.max_tokens):
            return FinishReason.LENGTH
        return None

    def _advance_grammar(self, token_id: int) -> bool:
        """Feeds the token to the grammar; False when that ends the request: the grammar reached its end (it
        accepted an EOS, which it allows only there), or refused the token. The sampler masks every token the
        grammar refuses, so a refusal means a broken invariant: the request stops rather than go on outside it."""
        assert self.grammar is not None
        if not self.grammar.accept(token_id):
            logger.error("request %s: its grammar refused token %d; stopping it", self.request_id, token_id)
            return False
        return not self.grammar.is_terminated
