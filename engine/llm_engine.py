"""The engine loop both node kinds run: requests in, one step at a time, tokens out.

A step is three calls: `scheduler.schedule()` -> `runner.execute(batch)` -> `_update(batch, tokens)`.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from engine.cache.block_pool import KVEvent
from engine.cache.kv_cache_manager import KVCacheManager
from engine.config import EngineConfig, ModelConfig
from engine.detokenizer import IncrementalDetokenizer, decode_token
from engine.hashing import BlockHash
from engine.request import Request, RequestStatus
from engine.runner import ModelRunner
from engine.sampler import SampledToken
from engine.scheduler import Scheduler
from engine.tokenizer import load_tokenizer
from engine.types import CompletionOutput, FinishReason, SamplingParams

logger = logging.getLogger(__name__)


class PromptBlocks(NamedTuple):
    block_ids: list[int]
    num_cached_tokens: int  # leading prompt tokens already in this engine's prefix cache


@dataclass(frozen=True)
class StepOutput:
    """What one step did to one request: the token it appended and whether that finished it."""

    request_id: str
    token_id: int
    finished: bool


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
        self.scheduler = Scheduler(self.kv, cfg.max_num_batched_tokens, cfg.max_num_seqs)
        self.requests: dict[str, Request] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._rng = random.Random(cfg.seed)
        # a request can never hold more tokens than the context or the whole pool
        self.max_tokens_per_request = min(self.max_model_len, self.runner.num_blocks * cfg.block_size)

    # ---- requests in ----
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer; this engine was started with skip_tokenizer_init")
        return list(self.tokenizer.encode(prompt))

    def make_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                     pin_blocks: bool = False) -> Request:
        """Validates a prompt and parameters into a Request (not yet queued).

        With pin_blocks, the request's K/V blocks outlive it until release_blocks(request_id)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n != 1:
            raise ValueError("the engine runs one sample per request; fan out n > 1 before (LLM.generate does)")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate_prompt(token_ids)
        if params.greedy:
            generator = None
        else:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
            # on the logits' device: a CPU generator for GPU logits costs a copy per row and step
            generator = torch.Generator(device=self.runner.device).manual_seed(seed)
        eos = frozenset() if params.ignore_eos else self.model_config.eos_token_ids
        return Request(request_id, token_ids, params, eos_token_ids=eos, prompt=text, generator=generator,
                       max_num_tokens=self.max_tokens_per_request, pin_blocks=pin_blocks)

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_tokens_per_request:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, but this model's context holds {self.max_model_len} "
                f"(max_model_len) and the KV cache {self.runner.num_blocks * self.config.block_size}; "
                f"the prompt must leave room for at least one generated token")

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                    pin_blocks: bool = False) -> Request:
        request = self.make_request(request_id, prompt, params, pin_blocks)
        self.submit(request)
        return request

    def submit(self, request: Request) -> None:
        """Queues a request made by make_request."""
        self._track(request)
        self.scheduler.add(request)

    def _track(self, request: Request) -> None:
        self.requests[request.request_id] = request
        if self.tokenizer is not None:
            self._detokenizers[request.request_id] = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, request.params)

    # ---- requests whose prompt K/V was computed elsewhere (the decode node's path) ----
    def reserve_prompt_blocks(self, request: Request) -> PromptBlocks | None:
        """Gives a made (not submitted) request blocks for its whole prompt, reusing this engine's own prefix
        cache. The caller fills blocks[num_cached_tokens // block_size:] and then calls admit_prefilled.
        Returns None when the pool cannot hold the prompt now."""
        cached = self.kv.find_cached_prefix(request)
        num_cached = len(cached) * self.kv.block_size
        if not self.kv.allocate(request, request.num_prompt_tokens - num_cached, cached):
            return None
        self.kv.record_lookup(request.num_prompt_tokens, num_cached)
        request.num_prompt_cached_tokens = num_cached
        return PromptBlocks(list(request.block_ids), num_cached)

    def admit_prefilled(self, request: Request, first_token: SampledToken | int) -> bool:
        """Admits a request whose prompt K/V now sit in its reserved blocks, with the first token sampled
        elsewhere. It joins the batch like any other: num_computed_tokens = len(prompt), one token to go.
        Returns True when the first token already finished it."""
        if isinstance(first_token, int):
            first_token = SampledToken(first_token)
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv.cache_computed_blocks(request)
        self._track(request)
        if self._append(request, first_token):
            request.status = RequestStatus.RUNNING
            self.scheduler.running.append(request)
            self.scheduler.finish(request)
            return True
        self.scheduler.add(request)
        return False

    def abort(self, request_id: str) -> None:
        """Ends a request wherever it is; its blocks (pinned or not) go back to the pool."""
        request = self.requests.pop(request_id, None)
        self._detokenizers.pop(request_id, None)
        if request is None:
            return
        if not request.finished:
            request.finish_reason = FinishReason.ABORT
            self.scheduler.finish(request)
        elif request.block_ids:
            self.kv.free(request)

    def release_blocks(self, request_id: str) -> None:
        """Frees the pinned blocks of a finished request and forgets it."""
        request = self.requests.get(request_id)
        if request is not None and request.finished:
            self.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ----
    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        sampled = self.runner.execute(batch)
        self.scheduler.advance(batch)
        outputs = []
        for request_id, token in sampled.items():
            request = self.requests[request_id]
            finished = self._append(request, token)
            if finished:
                self.scheduler.finish(request, free_blocks=not request.pin_blocks)
            outputs.append(StepOutput(request_id, token.token_id, finished))
        return outputs

    def _append(self, request: Request, token: SampledToken) -> bool:
        """Appends a sampled token, detokenizes it and decides whether the request is done."""
        request.token_ids.append(token.token_id)
        if token.logprobs is not None and request.logprobs is not None:
            if self.tokenizer is not None:
                token.logprobs.update({tid: replace(lp, decoded_token=decode_token(self.tokenizer, tid))
                                       for tid, lp in token.logprobs.items()})
            request.logprobs.append(token.logprobs)
            request.cumulative_logprob += token.logprobs[token.token_id].logprob
        params = request.params
        token_id = token.token_id
        stop_ids = params.stop_token_ids or []
        past_min = request.num_output_tokens >= params.min_tokens
        stop_token = past_min and (token_id in request.eos_token_ids or token_id in stop_ids)
        detok = self._detokenizers.get(request.request_id)
        # as in vLLM, the text of an EOS or stop token is not part of the output unless asked for
        if detok is not None and (not stop_token or params.include_stop_str_in_output):
            detok.push(token_id)
        if stop_token:
            request.finish_reason = FinishReason.STOP
            request.stop_reason = None if token_id in request.eos_token_ids else token_id
        elif past_min and detok is not None and (stop := detok.check_stop()) is not None:
            request.finish_reason, request.stop_reason = FinishReason.STOP, stop
        if request.finish_reason is None and (
                request.num_tokens >= request.max_num_tokens
                or (params.max_tokens is not None and request.num_output_tokens >= params.max_tokens)):
            request.finish_reason = FinishReason.LENGTH
        if request.finish_reason is not None and detok is not None:
            detok.flush()  # a character left unfinished at the end shows as U+FFFD, as in a full decode
        return request.finish_reason is not None

    # ---- prefix-cache events (what a node tells the cluster's prefix index) ----
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

    # ---- outputs ----
    def output(self, request_id: str) -> CompletionOutput:
        request = self.requests[request_id]
        detok = self._detokenizers.get(request_id)
        return CompletionOutput(
            index=0,
            text=detok.text if detok is not None else "",
            token_ids=request.output_token_ids,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=request.logprobs,
            cumulative_logprob=request.cumulative_logprob if request.logprobs is not None else None,
        )

    def release(self, request_id: str) -> None:
        """Forgets a finished request once its output has been read (pinned blocks stay pinned)."""
        request = self.requests.get(request_id)
        if request is not None and request.pin_blocks and request.block_ids:
            return
        self.requests.pop(request_id, None)
        self._detokenizers.pop(request_id, None)
