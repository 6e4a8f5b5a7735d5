"""The starlette app: the OpenAI API (/v1/models, /v1/completions, /v1/chat/completions, /v1/responses as a chat:
proxy/api/responses_api.py), vLLM's /tokenize and /detokenize (proxy/api/tokenize.py), /health, /metrics, and
/openapi.json (proxy/api/openapi.py) that describes them.

A request's path: authorize → read the body (at most --max-request-body-bytes: 413 beyond) → decode the JSON,
parse (openai_api) and tokenize (chat template for chat) on a tokenizer thread, off the event loop → check the
context length (400 beyond) → fan out its choices through the pipeline (serving) → format (responses), whole or
as SSE.
A streamed response starts only once the first token is there, so errors before it (429, 503, a node's
400) keep their HTTP status; later errors arrive as an error event before [DONE]. A client that goes
away, streaming or not, cancels its choices, which aborts them on the nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.config import ModelConfig, ModelConfigError
from proxy.api.errors import APIError
from proxy.api.metrics import poll_nodes
from proxy.api.openai_api import Generation
from proxy.api.openapi import ServedAPI, openapi_schema
from proxy.api.prepare import check_length, check_model, echoed_prompts, prepare_chat, prepare_completion
from proxy.api.request_body import read_body
from proxy.api.responses import (
    ChatFormat,
    ChoiceDelta,
    ChoiceResult,
    CompletionFormat,
    Header,
    UsageTally,
    sse,
)
from proxy.api.responses_api import ResponseRun, prepare_response
from proxy.api.serving import Parsing, ProxyState, SubRequest, fan_out, generate
from proxy.api.tokenize import detokenize, tokenize
from wire import Role

__all__ = ["ProxyState", "create_app", "read_max_model_len"]

logger = logging.getLogger(__name__)
T = TypeVar("T")
Format = CompletionFormat | ChatFormat


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


def read_max_model_len(model: Path, override: int | None = None) -> int | None:
    """The model's context length (max_position_embeddings: config.json, or a GGUF's metadata), capped by
    `override`; None when neither is known."""
    try:
        native: int | None = ModelConfig.from_path(model).max_position_embeddings
    except ModelConfigError:
        native = None  # the nodes refuse such a model with the reason; the proxy only loses its early check
    lengths = [x for x in (native, override) if isinstance(x, int) and x > 0]
    return min(lengths) if lengths else None


def create_app(state: ProxyState) -> Starlette:
    state.metrics.cluster.decision_counts = lambda: state.pipeline.router.decision_counts
    state.metrics.cluster.attempt_counts = lambda: state.pipeline.attempts.counts
    state.metrics.cluster.migration_counts = lambda: state.pipeline.migrations.counts
    state.pipeline.phases.sink = state.metrics.phases  # the phases nodes report, as histograms
    schema = openapi_schema(ServedAPI(state.served_model_name, len(state.tokenizer), state.max_model_len,
                                      state.max_request_body_bytes, bool(state.api_keys), state.limits,
                                      state.metrics_need_key))

    async def health(request: Request) -> Response:
        await state.pipeline.start()  # idempotent: /health sees registered nodes before any request
        nodes = await poll_nodes(state.pipeline.directory, with_stats=False)
        ready = {role.value: sum(1 for n in nodes if n.role is role and n.up) for role in Role}
        # a decode node can serve alone (the router colocates when no prefill node can take a request)
        status = "unavailable" if not ready["decode"] else "ok" if ready["prefill"] else "degraded"
        return JSONResponse({"status": status, "ready_nodes": ready}, status_code=503 if not ready["decode"] else 200)

    async def ready(request: Request) -> Response:
        # Kubernetes readiness: the proxy serves once its registry answers. Zero nodes is no reason to leave the
        # Service: the nodes come and go behind it (tandem:num_nodes says how many it sees).
        await state.pipeline.start()
        problem = await state.pipeline.directory.registry_problem()
        if problem is not None:
            return JSONResponse({"status": "unavailable", "reason": problem}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def live(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        if state.metrics_need_key:  # open by default, as vLLM's: Prometheus scrapes without a key
            try:
                _authorize(state, request)
            except APIError as e:
                return _error_response(e)
        await state.pipeline.start()
        state.metrics.cluster.nodes = await poll_nodes(state.pipeline.directory)
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict[str, Any]:
        return {"id": state.served_model_name, "object": "model", "created": 0, "owned_by": "tandem",
                "max_model_len": state.max_model_len}

    async def models(request: Request) -> Response:
        try:
            _authorize(state, request)
        except APIError as e:
            return _error_response(e)
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request: Request) -> Response:
        try:
            _authorize(state, request)
            check_model(state, request.path_params["model"])
        except APIError as e:
            return _error_response(e)
        return JSONResponse(model_card())

    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        try:
            _authorize(state, request)
            body = await read_body(request, state.max_request_body_bytes)
            parsed, prompts = await state.off_loop(prepare_completion, state, body)
            echo = await state.off_loop(echoed_prompts, state, parsed.prompts, prompts) if parsed.echo else None
        except APIError as e:
            return _error_response(e)
        return await _serve(request, state, CompletionFormat, prompts, parsed.generation, arrival, "prompt",
                            format_options={"echo": echo, "n": parsed.generation.params.n})

    async def chat_completions(request: Request) -> Response:
        arrival = time.monotonic()
        try:
            _authorize(state, request)
            body = await read_body(request, state.max_request_body_bytes)
            chat = await state.off_loop(prepare_chat, state, body)
        except APIError as e:
            return _error_response(e)
        return await _serve(request, state, ChatFormat, [chat.prompt_ids], chat.generation, arrival, "messages",
                            chat.parsing)

    async def responses(request: Request) -> Response:
        arrival = time.monotonic()
        try:
            _authorize(state, request)
            body = await read_body(request, state.max_request_body_bytes)
            run = ResponseRun(state, await state.off_loop(prepare_response, state, body), arrival)
            if not run.stream:
                return JSONResponse(await _unless_disconnected(request, run.whole()))
            first = await _unless_disconnected(request, run.first())
        except APIError as e:
            return _error_response(e)
        except (ClientGone, StopAsyncIteration):
            return Response(status_code=499)  # nobody reads it
        return StreamingResponse(run.events(first), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def tokenizer_endpoint(work: Callable[[ProxyState, bytes], dict[str, Any]]) -> Callable[..., Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                _authorize(state, request)
                body = await read_body(request, state.max_request_body_bytes)
                return JSONResponse(await state.off_loop(work, state, body))
            except APIError as e:
                return _error_response(e)

        return endpoint

    async def openapi(request: Request) -> Response:
        try:
            _authorize(state, request)
        except APIError as e:
            return _error_response(e)
        return JSONResponse(schema)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        # a 405's Allow header lists the methods the path takes (RFC 9110)
        return _error_response(APIError(exc.status_code, str(exc.detail), code=code, headers=dict(exc.headers or {})))

    async def client_gone(request: Request, exc: Exception) -> Response:
        return Response(status_code=499)  # left while sending its body: nobody reads an answer

    async def internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return _error_response(APIError(500, "internal error", code="internal_error", kind="server_error"))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await state.pipeline.start()
        try:
            yield
        finally:
            await state.pipeline.close()
            state.close()

    return Starlette(lifespan=lifespan, routes=[
        Route("/health", health), Route("/ready", ready), Route("/live", live), Route("/metrics", metrics),
        Route("/v1/models", models), Route("/v1/models/{model:path}", model),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]), Route("/openapi.json", openapi),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/tokenize", tokenizer_endpoint(tokenize), methods=["POST"]),
        Route("/detokenize", tokenizer_endpoint(detokenize), methods=["POST"]),
    ], exception_handlers={HTTPException: http_error, ClientDisconnect: client_gone, Exception: internal_error})


# ---- the request edge ----

def _authorize(state: ProxyState, request: Request) -> None:
    """proxy/api/auth.py: every path but the probes (/health, /ready, /live) and /metrics needs a key, when there are
    keys."""
    if state.api_keys and not state.api_keys.authorizes(request.headers):
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})


# ---- serving a request ----

async def _serve(request: Request, state: ProxyState, format_class: type[Format], prompts: list[list[int]],
                 generation: Generation, arrival: float, param: str, parsing: Parsing = None,
                 format_options: dict[str, Any] | None = None) -> Response:
    params = generation.params
    try:
        check_length(state.max_model_len, prompts, params.max_tokens, param)
    except APIError as e:
        return _error_response(e)
    header = Header(f"{format_class.id_prefix}-{uuid.uuid4().hex}", state.served_model_name, int(time.time()))
    fmt = format_class(header, params.logprobs is not None, generation.include_usage, **(format_options or {}))
    subs = fan_out(prompts, params)
    usage = UsageTally(sum(len(p) for p in prompts), params.n)
    deltas = generate(state, header.request_id, subs, arrival, parsing)
    try:
        if not generation.stream:
            results = await _unless_disconnected(request, _collect(deltas, subs, usage))
            return JSONResponse(fmt.whole(results, usage))
        first = await _unless_disconnected(request, anext(deltas))
    except APIError as e:
        return _error_response(e)
    except (ClientGone, StopAsyncIteration):
        return Response(status_code=499)  # nobody reads it
    continuous = generation.include_usage and generation.continuous_usage  # vLLM's: both must be asked for
    return StreamingResponse(_events(fmt, len(subs), first, deltas, usage, continuous), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _collect(deltas: AsyncGenerator[ChoiceDelta, None], subs: list[SubRequest], usage: UsageTally
                   ) -> list[ChoiceResult]:
    results = [ChoiceResult(sub.index) for sub in subs]
    try:
        async for delta in deltas:
            usage.add(delta)
            results[delta.index].add(delta)
    finally:
        await deltas.aclose()
    return results


async def _events(fmt: Format, num_choices: int, first: ChoiceDelta, deltas: AsyncGenerator[ChoiceDelta, None],
                  usage: UsageTally, continuous_usage: bool) -> AsyncIterator[str]:
    try:
        for opening in fmt.opening(num_choices):
            yield sse({**opening, "usage": usage.body()} if continuous_usage else opening)
        async for delta in _chain(first, deltas):
            usage.add(delta)
            chunk = fmt.chunk(delta)
            if chunk is not None:
                yield sse({**chunk, "usage": usage.body()} if continuous_usage else chunk)
        if fmt.include_usage:
            yield sse(fmt.closing(usage))
    except APIError as e:
        yield sse(e.body())
    finally:
        await deltas.aclose()  # the client went away: this aborts every choice on the nodes
    yield sse("[DONE]")


async def _chain(first: ChoiceDelta, rest: AsyncIterator[ChoiceDelta]) -> AsyncIterator[ChoiceDelta]:
    yield first
    async for delta in rest:
        yield delta


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone (and `work` cancelled) when the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnect(request: Request) -> None:
    # the body is read already: the next message is the disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _ErrorJSON(JSONResponse):
    """JSON with non-ASCII escaped: an error message quoting any text at all can always be sent."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _error_response(e: APIError) -> JSONResponse:
    return _ErrorJSON(e.body(), status_code=e.status, headers=e.headers)
