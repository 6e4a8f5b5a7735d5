"""The starlette app: /health, /v1/models, /v1/completions (streaming and not)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.detokenizer import IncrementalDetokenizer
from engine.types import FinishReason, SamplingParams
from proxy.clients import NodeError
from proxy.openai_api import APIError, CompletionRequest, bad_request, completion_chunk, parse_completion, usage
from proxy.pd import PDPipeline

logger = logging.getLogger(__name__)

_STATUS_OF_NODE_ERROR = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


@dataclass
class ProxyState:
    pipeline: PDPipeline
    tokenizer: Any
    served_model_name: str
    request_timeout_s: float = 600.0


class TextStream:
    """Token ids in, text out, with stop strings: text that could still become a stop string is held back
    until it cannot (or the request ends), so a stop string never leaks into a stream."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params)
        self.params = params
        self.holdback = max((len(s) for s in params.stop or []), default=1) - 1
        self.num_sent = 0
        self.stop_string: str | None = None

    def push(self, token_ids: list[int], stop_token_id: int | None) -> None:
        for token_id in token_ids:
            if token_id == stop_token_id and not self.params.include_stop_str_in_output:
                continue
            self.detok.push(token_id)
            self.stop_string = self.detok.check_stop()
            if self.stop_string is not None:
                return

    def take(self, final: bool) -> str:
        if final and self.stop_string is None:
            self.detok.flush()
        text = self.detok.text
        end = len(text) if final or self.stop_string is not None else max(self.num_sent, len(text) - self.holdback)
        delta = text[self.num_sent:end]
        self.num_sent = end
        return delta


def create_app(state: ProxyState) -> Starlette:
    async def health(request: Request) -> Response:
        checks = [c.health(timeout=1.0) for c in (*state.pipeline.prefill_nodes, *state.pipeline.decode_nodes)]
        try:
            replies = await asyncio.gather(*checks)
        except grpc.aio.AioRpcError as e:
            return JSONResponse({"status": "unavailable", "detail": e.details()}, status_code=503)
        if not all(r.ready for r in replies):
            return JSONResponse({"status": "unavailable", "detail": "a node is not ready"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": state.served_model_name, "object": "model", "created": 0, "owned_by": "tandem"}]})

    async def completions(request: Request) -> Response:
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise bad_request("the request body is not valid JSON") from None
            completion = parse_completion(body)
            if completion.model and completion.model != state.served_model_name:
                raise APIError(404, f"the model '{completion.model}' does not exist", "model", "model_not_found",
                               "NotFoundError")
            prompt_ids = _prompt_ids(state, completion)
        except APIError as e:
            return _error_response(e)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        params = dataclasses.replace(completion.params, stop=completion.stop,
                                     include_stop_str_in_output=completion.include_stop_str_in_output)
        chunks = _run(state, request_id, prompt_ids, params)
        if completion.stream:
            return StreamingResponse(_sse(state, request_id, chunks), media_type="text/event-stream")
        try:
            text, finish, num_out, cached = "", None, 0, 0
            async for delta, finish_reason, count, cached_now in chunks:
                text += delta
                num_out += count
                cached = cached_now if cached_now is not None else cached
                finish = finish_reason or finish
        except APIError as e:
            return _error_response(e)
        body = completion_chunk(request_id, state.served_model_name, text, finish)
        body["usage"] = usage(len(prompt_ids), num_out, cached)
        return JSONResponse(body)

    return Starlette(routes=[
        Route("/health", health), Route("/v1/models", models),
        Route("/v1/completions", completions, methods=["POST"]),
    ])


def _prompt_ids(state: ProxyState, completion: CompletionRequest) -> list[int]:
    if isinstance(completion.prompt, str):
        return list(state.tokenizer.encode(completion.prompt))
    vocab = len(state.tokenizer)
    if any(not 0 <= t < vocab for t in completion.prompt):
        raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
    return completion.prompt


async def _run(state: ProxyState, request_id: str, prompt_ids: list[int], params: SamplingParams
               ) -> AsyncIterator[tuple[str, str | None, int, int | None]]:
    """(text delta, finish reason, new token count, cached prompt tokens) per step of the request."""
    text = TextStream(state.tokenizer, prompt_ids, params)
    deadline = time.time() + state.request_timeout_s
    stream = state.pipeline.generate(request_id, prompt_ids, params, deadline)
    try:
        async for chunk in stream:
            text.push(chunk.token_ids, chunk.stop_token_id)
            if text.stop_string is not None:
                yield text.take(final=True), str(FinishReason.STOP), len(chunk.token_ids), chunk.num_cached_tokens
                return  # closing the stream aborts the rest of the request on the nodes
            finish = str(chunk.finish_reason) if chunk.finish_reason else None
            yield text.take(final=finish is not None), finish, len(chunk.token_ids), chunk.num_cached_tokens
    except NodeError as e:
        logger.warning("request %s failed: %s", request_id, e)
        raise APIError(_STATUS_OF_NODE_ERROR.get(e.code, 502), str(e), code=e.code.name.lower(),
                       kind="server_error" if e.code not in _STATUS_OF_NODE_ERROR else "invalid_request_error"
                       ) from e
    finally:
        await stream.aclose()


async def _sse(state: ProxyState, request_id: str,
               chunks: AsyncIterator[tuple[str, str | None, int, int | None]]) -> AsyncIterator[str]:
    created = int(time.time())
    try:
        async for delta, finish, _, _ in chunks:
            if delta or finish:
                payload = completion_chunk(request_id, state.served_model_name, delta, finish, created)
                yield f"data: {json.dumps(payload)}\n\n"
    except APIError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
    yield "data: [DONE]\n\n"


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
