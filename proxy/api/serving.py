"""One HTTP request's generations: every choice (n samples of each prompt) runs through the P/D pipeline
concurrently and comes back as a stream of ChoiceDeltas: text, token count, logprobs, finish. The nodes send
token ids; each choice's engine.output_processor.OutputProcessor turns them into text (stop strings, EOS text,
holdback).

Closing that stream (the client went away, or an error in one choice) closes every choice's pipeline
stream, which aborts the request on the decode node and releases the ticket on the prefill node.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from engine.output_processor import OutputDelta, OutputProcessor
from engine.types import PositionLogprobs, PromptLogprobs, SamplingParams
from proxy.api.auth import APIKeys
from proxy.api.choice_parser import ChoiceParser
from proxy.api.errors import APIError
from proxy.api.limits import RequestLimits
from proxy.api.metrics import ProxyMetrics
from proxy.api.request_body import DEFAULT_MAX_REQUEST_BODY_BYTES
from proxy.api.responses import MIN_LOGPROB, ChoiceDelta, TokenLogprob, finite
from proxy.routing.clients import NodeError
from proxy.routing.errors import NoHealthyNodes, Overloaded, without_addresses
from proxy.routing.pd import PDPipeline, TokenChunk
from settings.chat import ChatSettings

logger = logging.getLogger(__name__)
T = TypeVar("T")
Parsing = Callable[[], ChoiceParser] | None  # a factory of each choice's text parser (reasoning, tool calls)

# Threads that decode and tokenize request bodies. More than one, so that one huge body does not hold up the
# requests behind it; Hugging Face's fast tokenizers release the GIL while they encode.
DEFAULT_TOKENIZER_THREADS = 4

_STATUS_OF_NODE_ERROR = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


@dataclass
class ProxyState:
    """What the HTTP layer serves with. `max_model_len` bounds prompt + max_tokens (HTTP 400 beyond);
    `max_num_requests` bounds the choices in flight at this proxy (HTTP 429 beyond); `max_request_body_bytes`
    a request's body (HTTP 413 beyond); `limits` a request's n, logprobs and max_tokens (HTTP 400 beyond);
    `api_keys` who may call (HTTP 401 without one of them; none: open), /metrics too when `metrics_need_key`.
    Bodies are decoded and tokenized on `tokenizer_threads` threads, never on the event loop, so that a big one
    stalls no stream and no health check."""

    pipeline: PDPipeline
    tokenizer: Any
    served_model_name: str
    request_timeout_s: float = 600.0
    max_model_len: int | None = None
    api_keys: APIKeys = field(default_factory=APIKeys)
    max_num_requests: int | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    tokenizer_threads: int = DEFAULT_TOKENIZER_THREADS
    limits: RequestLimits = field(default_factory=RequestLimits)
    metrics_need_key: bool = False
    chat: ChatSettings = field(default_factory=ChatSettings)  # tool-call and reasoning parsers
    metrics: ProxyMetrics = field(init=False)  # each state its own registry: several apps fit in one process
    num_running: int = field(init=False, default=0)  # choices in flight
    # each token's text on its own (for logprobs), shared by every request's OutputProcessor
    token_texts: dict[int, str] = field(init=False, default_factory=dict, repr=False)
    _executor: ThreadPoolExecutor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_request_body_bytes <= 0 or self.tokenizer_threads <= 0:
            raise ValueError("max_request_body_bytes and tokenizer_threads must be positive")
        self.metrics = ProxyMetrics(self.served_model_name)
        # threads start on first use and end with close() (or the process)
        self._executor = ThreadPoolExecutor(self.tokenizer_threads, thread_name_prefix="proxy-tokenize")

    async def off_loop(self, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` on a tokenizer thread: CPU-heavy request preparation that must not block the loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(work, *args))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True)
class SubRequest:
    """One choice: a prompt and one sample's parameters (n=1, its own seed)."""

    index: int  # the choice index: prompt_index * n + sample_index
    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    params: SamplingParams


def fan_out(prompts: Sequence[list[int]], params: SamplingParams) -> list[SubRequest]:
    """n samples of each prompt, seeds spread as engine SamplingParams.for_sample does (seed + i)."""
    return [SubRequest(p * params.n + i, p, i, prompt, params.for_sample(i))
            for p, prompt in enumerate(prompts) for i in range(params.n)]


def api_error(e: Exception) -> APIError:
    """The OpenAI error for what the routing layer or a node reported."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, Overloaded):
        return APIError(429, str(e) or "the cluster is overloaded; retry later", code="overloaded",
                        kind="rate_limit_error", headers={"Retry-After": str(max(1, round(e.retry_after_s)))})
    if isinstance(e, NoHealthyNodes):
        return APIError(503, str(e) or "no healthy nodes", code="no_healthy_nodes", kind="service_unavailable")
    if isinstance(e, NodeError):
        status = _STATUS_OF_NODE_ERROR.get(e.code, 502)
        kind = {429: "rate_limit_error", 503: "service_unavailable"}.get(
            status, "invalid_request_error" if status < 500 else "server_error")
        headers = {"Retry-After": "1"} if status in (429, 503) else None
        return APIError(status, _client_message(e), code=e.code.name.lower(), kind=kind, headers=headers)
    logger.exception("internal error", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}", code="internal_error", kind="server_error")


def _client_message(e: NodeError) -> str:
    """What a client is told of a node's failure: never the node's address (the log has it, with the whole
    error), nor the transport's own words for an unreachable node."""
    if e.unreachable:
        return f"a {e.role} node could not be reached; retry later"
    address = e.node.split(" ", 1)[1] if " " in e.node else ""
    return f"the {e.role} node failed the request: {without_addresses(e.message, (address,))}"


def _feed(output: OutputProcessor, chunk: TokenChunk) -> list[OutputDelta]:
    """Feeds a chunk's tokens to the choice's output; the chunk's finish belongs to its last token. Tokens
    after a stop string are not fed: the request ends there."""
    deltas = []
    for i, token_id in enumerate(chunk.token_ids):
        logprobs = chunk.logprobs[i] if i < len(chunk.logprobs) else None
        last = i == len(chunk.token_ids) - 1
        deltas.append(output.update(token_id, logprobs, chunk.finish_reason if last else None,
                                    chunk.stop_token_id if last else None))
        if output.finished:
            break
    if not chunk.token_ids and chunk.finish_reason is not None:  # a finish reported after its token
        deltas.append(output.finish(chunk.finish_reason, chunk.stop_token_id))
    return deltas


def _token_logprob(output: OutputProcessor, token_id: int, position: PositionLogprobs, num_top: int
                   ) -> TokenLogprob:
    """The sampled token's logprob and the num_top best at its position, with each token's own text."""
    sampled = position.get(token_id)
    ranked = sorted(position.items(), key=lambda item: item[1].rank)[:num_top]
    return TokenLogprob(output.token_text(token_id), finite(sampled.logprob) if sampled else MIN_LOGPROB,
                        [(output.token_text(t), finite(lp.logprob)) for t, lp in ranked])


async def _run_one(state: ProxyState, request_id: str, sub: SubRequest, arrival: float, parsing: Parsing
                   ) -> AsyncGenerator[ChoiceDelta, None]:
    output = OutputProcessor(state.tokenizer, sub.prompt_token_ids, sub.params, state.token_texts)
    parser = parsing() if parsing is not None else None
    num_top = sub.params.logprobs
    deadline = time.time() + state.request_timeout_s
    recorder = state.metrics.request(arrival, len(sub.prompt_token_ids))
    stream = state.pipeline.generate(f"{request_id}-{sub.index}", sub.prompt_token_ids, sub.params, deadline)
    try:
        async for chunk in stream:
            deltas = _feed(output, chunk)
            tokens = [(d.token_id, d.logprobs) for d in deltas if d.token_id is not None]
            recorder.on_tokens(len(tokens))
            logprobs = [] if num_top is None else [_token_logprob(output, token_id, position, num_top)
                                                   for token_id, position in tokens if position]
            finish = str(output.finish_reason) if output.finish_reason is not None else None
            if finish is not None:
                recorder.finish(finish)
            text = "".join(d.text for d in deltas)
            prompt = _prompt_logprobs(output, chunk.prompt_logprobs) if chunk.prompt_logprobs is not None else None
            if parser is None:
                yield ChoiceDelta(sub.index, text, len(tokens), logprobs, finish, chunk.num_cached_tokens,
                                  prompt_logprobs=prompt)
            else:
                delta = _parsed_delta(sub.index, parser, text, len(tokens), logprobs, finish, chunk.num_cached_tokens)
                yield dataclasses.replace(delta, prompt_logprobs=prompt)
            if finish is not None:
                return  # after a stop string, closing the stream aborts the rest on the nodes
    except Exception as e:
        error = api_error(e)
        if error.status >= 500 or isinstance(e, NodeError):  # the node's address is told here, not to the client
            logger.warning("request %s choice %d failed: %s", request_id, sub.index, e)
        recorder.fail(error.code or str(error.status))
        raise error from e
    finally:
        await stream.aclose()
        recorder.close()


def _prompt_logprobs(output: OutputProcessor, positions: PromptLogprobs) -> list[dict[str, Any] | None]:
    """vLLM's JSON shape: None for the first position, then token id (as text) -> logprob, rank, decoded token."""
    return [None if position is None else {
        str(token_id): {"logprob": finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
        for token_id, lp in position.items()} for position in output.with_decoded_prompt_tokens(positions)]


def _parsed_delta(index: int, parser: ChoiceParser, text: str, num_tokens: int, logprobs: list[TokenLogprob],
                  finish: str | None, num_cached_tokens: int | None) -> ChoiceDelta:
    """A delta of a choice whose text is parsed (reasoning, tool calls). A choice that called tools and ended
    on its own finishes with "tool_calls", as OpenAI's do."""
    parsed = parser.feed(text)
    if finish is not None:
        parsed = parsed + parser.finish()
        if finish == "stop" and parser.made_calls:
            finish = "tool_calls"
    return ChoiceDelta(index, parsed.content, num_tokens, logprobs, finish, num_cached_tokens, parsed.reasoning,
                       parsed.tool_calls)


async def generate(state: ProxyState, request_id: str, subs: list[SubRequest], arrival: float,
                   parsing: Parsing = None) -> AsyncGenerator[ChoiceDelta, None]:
    """The deltas of all choices, interleaved as they come. An error in any choice ends them all and is
    raised as an APIError; so is admission beyond max_num_requests (429)."""
    limit = state.max_num_requests
    if limit is not None and state.num_running + len(subs) > limit:
        raise api_error(Overloaded(f"{state.num_running} requests are in flight at this proxy (limit {limit})"))
    state.num_running += len(subs)
    try:
        if len(subs) == 1:
            async with contextlib.aclosing(_run_one(state, request_id, subs[0], arrival, parsing)) as one:
                async for delta in one:
                    yield delta
            return
        async for delta in _merged(state, request_id, subs, arrival, parsing):
            yield delta
    finally:
        state.num_running -= len(subs)


async def _merged(state: ProxyState, request_id: str, subs: list[SubRequest], arrival: float, parsing: Parsing
                  ) -> AsyncGenerator[ChoiceDelta, None]:
    queue: asyncio.Queue[ChoiceDelta | APIError | None] = asyncio.Queue()  # None: a choice ended

    async def pump(sub: SubRequest) -> None:
        try:
            async with contextlib.aclosing(_run_one(state, request_id, sub, arrival, parsing)) as one:
                async for delta in one:
                    queue.put_nowait(delta)
            queue.put_nowait(None)
        except APIError as e:
            queue.put_nowait(e)

    tasks = [asyncio.create_task(pump(sub)) for sub in subs]
    try:
        num_running = len(tasks)
        while num_running:
            item = await queue.get()
            if item is None:
                num_running -= 1
            elif isinstance(item, APIError):
                raise item
            else:
                yield item
    finally:
        # cancelling a pump closes its choice's pipeline stream: the nodes abort and release
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
