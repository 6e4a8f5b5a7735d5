"""Prefill then decode: one request's path through the cluster, as a stream of token chunks.

P computes the prompt's K/V and the first token; the first token goes to the client at once; D pulls the K/V
and streams the rest. A retryable failure after the first token re-runs prefill only for a fresh ticket (the
K/V depends on the prompt alone, so the first token already sent stays valid), at most `max_retries` times.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from engine.types import FinishReason, PositionLogprobs, SamplingParams
from proxy.clients import DecodeClient, NodeError, PrefillClient, Prefilled

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenChunk:
    token_ids: list[int]
    logprobs: list[PositionLogprobs]
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    num_cached_tokens: int | None = None  # on the first chunk: the prefill node's prefix hit


class PDPipeline:
    def __init__(self, prefill: list[PrefillClient], decode: list[DecodeClient], max_retries: int = 1) -> None:
        if not prefill or not decode:
            raise ValueError("need at least one prefill and one decode node")
        self.prefill_nodes = prefill
        self.decode_nodes = decode
        self.max_retries = max_retries
        self._next_prefill = itertools.cycle(range(len(prefill)))
        self._next_decode = itertools.cycle(range(len(decode)))

    def _pick_prefill(self) -> PrefillClient:
        return self.prefill_nodes[next(self._next_prefill)]

    def _pick_decode(self) -> DecodeClient:
        return self.decode_nodes[next(self._next_decode)]

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       deadline: float) -> AsyncGenerator[TokenChunk, None]:
        prefill = self._pick_prefill()
        prefilled = await prefill.prefill(request_id, prompt_token_ids, params, deadline)
        first_logprobs = [prefilled.first_logprobs] if prefilled.first_logprobs else []
        yield TokenChunk([prefilled.first_token], first_logprobs, prefilled.finish_reason,
                         num_cached_tokens=prefilled.num_cached_tokens)
        if prefilled.finish_reason is not None or prefilled.ticket is None:
            return
        decode = self._pick_decode()
        finished = False
        attempt = 0
        try:
            while True:
                try:
                    async for out in decode.generate(request_id, prompt_token_ids, params, prefilled, deadline):
                        finished = out.finish_reason is not None
                        yield TokenChunk(out.token_ids, out.logprobs, out.finish_reason, out.stop_token_id)
                    return
                except NodeError as e:
                    attempt += 1
                    if not e.retryable or attempt > self.max_retries:
                        raise
                    logger.warning("request %s: %s; prefilling again for a fresh ticket", request_id, e)
                    await prefill.release(prefilled.ticket)
                    prefill = self._pick_prefill()
                    again = await prefill.prefill(f"{request_id}-retry{attempt}", prompt_token_ids, params,
                                                  deadline)
                    if again.ticket is None:
                        raise
                    prefilled = Prefilled(prefilled.first_token, prefilled.first_logprobs, None,
                                          prefilled.num_cached_tokens, again.ticket)
        finally:
            if not finished:
                # client gone, deadline or error: stop D's work and free P's pinned blocks
                await asyncio.shield(_cleanup(decode, prefill, request_id, prefilled))


async def _cleanup(decode: DecodeClient, prefill: PrefillClient, request_id: str, prefilled: Prefilled) -> None:
    await decode.abort(request_id)
    if prefilled.ticket is not None:
        await prefill.release(prefilled.ticket)
