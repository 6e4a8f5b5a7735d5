"""One request's state, all in one place (the scheduler, KV manager and runner read and update it)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from engine.hashing import BlockHash
from engine.types import FinishReason, PositionLogprobs, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks given back; recomputes its tokens when scheduled again
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A sequence being generated. Phase-free: `num_computed_tokens` just catches up with `token_ids`.

    token_ids = prompt + output. Tokens [0, num_computed_tokens) have their K/V in `block_ids`; once
    num_computed_tokens == num_tokens the last step produced logits and a new token was appended.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    prompt: str | None = None
    generator: torch.Generator | None = None
    max_num_tokens: int = 0  # context limit: the request finishes with LENGTH when it has this many tokens
    pin_blocks: bool = False  # keep the K/V blocks after finishing, until released (a prefill node's ticket)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache
    num_prompt_cached_tokens: int = 0  # prefix-cache hit when first scheduled
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
