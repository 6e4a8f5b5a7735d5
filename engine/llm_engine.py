"""The engine loop both node kinds and the offline LLM run: requests in, one step at a time, tokens out.

A step is three calls: `scheduler.schedule()` -> `runner.execute(batch)` -> `scheduler.update_from_output(batch,
sampled)`. The scheduler owns the requests and their states (engine/request.py has the state diagram); this
class is the API around it: make and add requests, reserve and admit a prompt whose K/V comes from another node,
`abort()` or `free_pinned()` them, read stats. The engine works in token ids: text is the output processor's
(engine/output_processor.py), in the offline LLM and in the proxy.

Asynchronous scheduling (config.async_scheduling) overlaps the host with the device. A step() call then
schedules and launches step N+1, and only then reads step N's sampled tokens (waiting for the device there)
and turns them into outputs, while step N+1 runs:

    host:    schedule N+1 | launch N+1 | read N, outputs of N ||  schedule N+2 | launch N+2 | read N+1 ...
    device:  ... N ...............................| N+1 ........................................| N+2

So step() returns the outputs of the step launched by the call before (same StepOutputs, one call later),
and a request that an EOS or stop token ends runs one extra step whose token is discarded (length limits are
known without the token: such a request is not scheduled again). A request with penalties needs its output
ids to sample, and a constrained one (structured output) its grammar advanced by its last token: while one is in
flight, step() reads that step first (no overlap of scheduling for that step). Its grammar's mask is still
computed while the device runs the step's forward pass (engine/runner.py).

Speculative decoding (config.speculative_config, engine/spec_decode/) runs synchronously: a step's accepted
drafts decide where the next step starts, so it is planned only once they are read. It turns asynchronous
scheduling off (logged). A step() then returns one StepOutput per token it appended: several for a request
whose drafts were accepted. Constrained requests get no drafts.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.cache.block_pool import KVEvent
from engine.cache.kv_cache_manager import KVCacheManager
from engine.config import EngineConfig, ModelConfig
from engine.hashing import BlockHash
from engine.kv_tiers import HostTierStats, KVTiers
from engine.request import Request, RequestStatus
from engine.runner import ModelRunner
from engine.sampled_step import SampledStep
from engine.sampler import SampledToken, has_penalties
from engine.scheduler import ReservedBlocks, Scheduler, SchedulerOutput
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import NgramProposer
from engine.structured_output import StructuredOutputCompiler
from engine.tokenizer import load_tokenizer
from engine.types import SamplingParams, StepOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PinnedBlocks:
    """A FINISHED_PINNED request's blocks: what a prefill node's ticket describes."""

    block_ids: tuple[int, ...]
    num_tokens: int  # prompt tokens whose K/V the blocks hold


@dataclass(frozen=True)
class InFlightStep:
    """A launched step whose samples the host has not read yet."""

    batch: SchedulerOutput
    sampled: SampledStep
    # a request of the step samples with penalties: its next step needs this step's token id on the host
    needs_output_ids: bool


@dataclass(frozen=True)
class EngineStats:
    """What a node reports about its engine (torch-free numbers)."""

    total_kv_blocks: int
    free_kv_blocks: int
    block_size: int
    num_running: int
    num_waiting: int
    num_queued_prefill_tokens: int  # tokens still to prefill (or recompute) in the running and waiting requests
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    max_num_seqs: int
    max_num_batched_tokens: int
    # speculative decoding, as vLLM's metrics count it (0 when it is off)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    host_tier: HostTierStats | None = None  # None: no host tier


class LLMEngine:
    def __init__(self, cfg: EngineConfig) -> None:
        self.config = cfg
        self.model_config = ModelConfig.from_path(cfg.model)
        limit = self.model_config.max_position_embeddings
        if cfg.max_model_len is not None and cfg.max_model_len > limit:
            raise ValueError(f"max_model_len {cfg.max_model_len} exceeds the model's context ({limit})")
        self.max_model_len = cfg.max_model_len or limit
        self.tokenizer = None if cfg.skip_tokenizer_init else load_tokenizer(self.model_config.path)
        self.runner = ModelRunner(cfg, self.model_config, self.max_model_len)
        self.kv = KVCacheManager(self.runner.num_blocks, cfg.block_size, cfg.enable_prefix_caching,
                                 cfg.hash_seed)
        self.tiers: KVTiers | None = None
        if cfg.kv_offloading_bytes:  # one rank only (EngineConfig checks)
            self.tiers = KVTiers(self.kv, self.runner.kv_cache, cfg.kv_offloading_bytes)
        spec = SpeculativeConfig.parse(cfg.speculative_config)
        proposer = None if spec is None else NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                                           spec.prompt_lookup_max)
        self.scheduler = Scheduler(self.kv, cfg.max_num_batched_tokens, cfg.max_num_seqs, proposer)
        self._rng = random.Random(cfg.seed)
        self.async_scheduling = (cfg.async_scheduling if cfg.async_scheduling is not None
                                 else self.runner.device.type == "cuda")
        if spec is not None and self.async_scheduling:
            log = logger.warning if cfg.async_scheduling else logger.info
            log("speculative decoding (%s, %d tokens) runs synchronously: asynchronous scheduling is off",
                spec.method, spec.num_speculative_tokens)
            self.async_scheduling = False
        self._in_flight: InFlightStep | None = None
        # a request can never hold more tokens than the context or the whole pool
        self.max_tokens_per_request = min(self.max_model_len, self.runner.num_blocks * cfg.block_size)
        self.structured_outputs = StructuredOutputCompiler(self.model_config.path, self.model_config.vocab_size,
                                                           self.model_config.eos_token_ids, self.tokenizer)

    @property
    def requests(self) -> Mapping[str, Request]:
        """Every request the engine holds: unfinished ones and pinned ones (read-only)."""
        return self.scheduler.requests

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def kv_cache(self) -> torch.Tensor:
        """The KV pool, [num_blocks, ...] block-major (engine/layers/attention.py): what transfers register."""
        return self.runner.kv_cache

    @property
    def kv_cache_dtype(self) -> str:
        """What the pool's blocks hold: the model dtype's name ("bfloat16", ...) or "fp8_e4m3" (e4m3 values with
        their scales, engine/layers/kv_fp8.py). Nodes pair only with peers whose blocks hold the same."""
        return self.runner.kv_cache_dtype

    # ---- requests in ----
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer; this engine was started with skip_tokenizer_init")
        return list(self.tokenizer.encode(prompt))

    def make_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                     pin_blocks: bool = False, output_token_ids: Sequence[int] = ()) -> Request:
        """Validates a prompt and parameters into a Request (not yet added).

        With pin_blocks, the request finishes as FINISHED_PINNED: its blocks stay until free_pinned().
        `output_token_ids` continue a request that generated them elsewhere (a decode node that was lost): they
        are computed with the prompt, as a preempted request's are recomputed, and count as output, so that
        max_tokens, min_tokens, the penalties and the seeded noise of the next token are those of the request
        that was not interrupted."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n != 1:
            raise ValueError("the engine runs one sample per request; fan out n > 1 before (LLM.generate does)")
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        output = list(output_token_ids)
        self._validate_prompt(token_ids, output)
        if params.logit_bias:
            self.validate_token_ids(list(params.logit_bias), "logit_bias token id")
        if params.max_tokens is not None and len(output) >= params.max_tokens:
            raise ValueError(f"the request has already generated {len(output)} tokens of max_tokens "
                             f"{params.max_tokens}: nothing is left to generate")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        eos = frozenset() if params.ignore_eos else self.model_config.eos_token_ids
        request = Request(request_id, token_ids, params, eos_token_ids=eos, seed=seed,
                          max_num_tokens=self.max_tokens_per_request, pin_blocks=pin_blocks,
                          token_ids=[*token_ids, *output])
        if params.structured_outputs is not None:
            request.grammar = self.structured_outputs.grammar(params.structured_outputs)
            for token_id in output:  # a continuation: its grammar stands where the interrupted request's stood
                if not request.grammar.accept(token_id) or request.grammar.is_terminated:
                    raise ValueError(f"output token id {token_id} does not follow the request's structured output")
        return request

    def validate_first_token(self, request: Request, token_id: int) -> None:
        """ValueError unless `token_id` may be the first token of a made request (in the vocabulary, and allowed
        by its grammar): a decode node checks the token a prefill node sampled before pulling anything."""
        self.validate_token_ids([token_id], "first token id")
        if request.grammar is not None and not request.grammar.allows(token_id, self.model_config.vocab_size):
            raise ValueError(f"first token id {token_id} does not follow the request's structured output")

    def validate_token_ids(self, token_ids: Sequence[int], what: str) -> None:
        """ValueError naming the first of `token_ids` (`what`: "prompt token id", ...) outside the vocabulary: a
        token the model has no embedding for must never reach a step (it would end the engine thread)."""
        if not token_ids:
            return
        vocab = self.model_config.vocab_size
        # the common case in C (type, min, max): a decode node validates every handed-off prompt on its engine
        # thread, where a per-token Python loop over an 8k-token prompt costs a sizeable part of a decode step
        valid = set(map(type, token_ids)) == {int} and 0 <= min(token_ids) and max(token_ids) < vocab
        bad = None if valid else next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"{what} {bad!r} is outside the vocabulary [0, {vocab})")

    def _validate_prompt(self, token_ids: list[int], output_token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token")
        self.validate_token_ids(token_ids, "prompt token id")
        self.validate_token_ids(output_token_ids, "output token id")
        num_tokens = len(token_ids) + len(output_token_ids)
        if num_tokens >= self.max_tokens_per_request:
            raise ValueError(
                f"{'prompt' if not output_token_ids else 'prompt and output so far'} has {num_tokens} tokens, but "
                f"this model's context holds {self.max_model_len} (max_model_len) and the KV cache "
                f"{self.runner.num_blocks * self.config.block_size}; the prompt must leave room for at least one "
                "generated token")

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                    pin_blocks: bool = False, output_token_ids: Sequence[int] = ()) -> Request:
        request = self.make_request(request_id, prompt, params, pin_blocks, output_token_ids)
        self.submit(request)
        return request

    def submit(self, request: Request) -> None:
        """Queues a request made by make_request."""
        self.scheduler.add(request)

    # ---- a prompt whose K/V is computed elsewhere (the decode node's path) ----
    def reserve_remote_kv(self, request: Request) -> ReservedBlocks | None:
        """Reserves blocks for a made request's whole prompt, reusing this engine's own prefix cache; the
        caller fills blocks[num_cached_blocks:] and then calls admit_remote_kv (or abort). None when the pool
        cannot hold the prompt now."""
        if self._in_flight is not None:
            # blocks freed while a step is in flight may still be written by it (a finished or aborted
            # request's last slot): the device orders that before the next step's writes, but not before
            # a transfer's, so wait for the step before handing blocks to one
            self._in_flight.sampled.wait()
        reserved = self.scheduler.reserve_remote_kv(request)
        if self.tiers is not None:  # spills out of the blocks the transfer writes, loads of the host tier's hits
            self.tiers.run_copies(wait=True)
        return reserved

    def admit_remote_kv(self, request_id: str, first_token: SampledToken) -> StepOutput:
        """The reserved blocks now hold the prompt's K/V and `first_token` was sampled elsewhere: the request
        joins the batch. The returned output says whether that first token already finished it."""
        self.validate_token_ids([first_token.token_id], "first token id")
        return self.scheduler.admit_remote_kv(request_id, first_token)

    # ---- requests out ----
    def abort(self, request_id: str) -> bool:
        """Ends a request in any state (pinned ones included); its blocks go back. Whether it was here."""
        return self.scheduler.abort(request_id)

    def free_pinned(self, request_id: str) -> bool:
        """Frees a FINISHED_PINNED request's blocks. False when it is not pinned here."""
        return self.scheduler.free_pinned(request_id)

    def pinned_blocks(self, request_id: str) -> PinnedBlocks | None:
        """The blocks of a FINISHED_PINNED request, or None when it is not (or no longer) pinned here."""
        request = self.requests.get(request_id)
        if request is None or request.status is not RequestStatus.FINISHED_PINNED:
            return None
        return PinnedBlocks(tuple(request.block_ids), request.num_prompt_tokens)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ----
    def step(self) -> list[StepOutput]:
        """Runs a step; returns what it appended to each request (with asynchronous scheduling: what the
        step launched by the previous call appended, see the module docstring)."""
        if self.async_scheduling:
            return self._step_async()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        self._run_kv_copies()
        sampled = self.runner.execute(batch)
        return self.scheduler.update_from_output(batch, sampled.tokens(), sampled.prompt_logprobs())

    def _step_async(self) -> list[StepOutput]:
        outputs = []
        if self._in_flight is not None and self._in_flight.needs_output_ids:
            outputs = self._read_in_flight()
        batch = self.scheduler.schedule()
        launched = None
        if not batch.is_empty:
            self._run_kv_copies()
            needs_output_ids = any(item.samples and (has_penalties(item.request.params)
                                                     or item.request.grammar is not None)
                                   for item in batch.scheduled)
            launched = InFlightStep(batch, self.runner.execute(batch), needs_output_ids)
        # the device runs `launched` meanwhile
        outputs += self._read_in_flight()
        self._in_flight = launched
        return outputs

    def _run_kv_copies(self) -> None:
        """The host tier's spills and loads the schedule planned, on the device's stream before the step."""
        if self.tiers is not None:
            self.tiers.run_copies()

    def _read_in_flight(self) -> list[StepOutput]:
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return []
        sampled = in_flight.sampled
        return self.scheduler.update_from_output(in_flight.batch, sampled.tokens(), sampled.prompt_logprobs())

    def close(self) -> None:
        """Stops the engine's tensor-parallel worker processes (a single-rank engine has none)."""
        self.runner.close()

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def rank_state(self) -> dict[str, Any]:
        """This rank's state, the one call_ranks' functions get here (rank 0)."""
        return self.runner.rank_state

    @property
    def tensor_parallel_size(self) -> int:
        return self.runner.parallel.tp_size

    def call_ranks(self, path: str, *args: Any) -> list[Any]:
        """Runs "module:function"(rank_state, *args) on each tensor-parallel rank (engine/runner.py); on the
        engine thread."""
        return self.runner.call_ranks(path, *args)

    # ---- what the engine tells the outside ----
    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        spec = scheduler.spec_stats
        queued = 0
        for request in (*scheduler.waiting, *scheduler.running):
            to_compute = request.num_tokens_with_pending - request.num_computed_tokens
            # one token to compute is a decode step; more (or none computed: new or preempted) is prefill work
            if to_compute > 1 or request.num_computed_tokens == 0:
                queued += to_compute
        return EngineStats(
            total_kv_blocks=self.kv.num_blocks, free_kv_blocks=self.kv.num_free_blocks, block_size=self.block_size,
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            num_queued_prefill_tokens=queued, prefix_cache_queries=self.kv.num_queried_tokens,
            prefix_cache_hits=self.kv.num_hit_tokens, num_preemptions=scheduler.num_preemptions,
            max_num_seqs=self.config.max_num_seqs, max_num_batched_tokens=self.config.max_num_batched_tokens,
            spec_decode_num_drafts=spec.num_drafts, spec_decode_num_draft_tokens=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
            host_tier=None if self.tiers is None else self.tiers.stats())

    def enable_kv_events(self) -> None:
        """Starts recording prefix-cache changes. Off by default: offline, nobody would drain them."""
        if self.kv.pool.events is None:
            self.kv.pool.events = []

    def drain_kv_events(self) -> list[KVEvent]:
        """The prefix-cache changes since the last drain, oldest first (empty unless enabled)."""
        events = self.kv.pool.events
        if not events:
            return []
        self.kv.pool.events = []
        return events

    def cached_block_hashes(self) -> list[BlockHash]:
        """Every prefix block this engine's cache can find now: a snapshot to resynchronise a listener."""
        return self.kv.pool.cached_hashes()
