"""One request's path through the cluster, as a stream of token chunks.

The router picks D, the mode and P (proxy/routing/router.py).
- Colocated: D prefills the prompt itself and streams every token.
- Disaggregated: P computes the prompt's K/V and the first token; the first token goes to the client at once;
  D pulls the K/V and streams the rest.
Each RPC to a node is an attempt (proxy.routing.attempts): the proxy abandons it, cancelling the RPC, when the node
is lost (health checks, proxy.routing.liveness) or the attempt makes no progress within its timeout, and then treats
it as a retryable failure of that node. Failures, at most `max_retries` retries per request in all:
- a node that a call finds unreachable, or that the proxy gave up on, is marked down in the directory
  (proxy.routing.dead_nodes): routing leaves it out for a short back-off, so the requests after this one do not try it
  first;
- a retryable prefill failure runs the prefill again on another P (the same one only when no other can). When
  no prefill node is left at all, D prefills the prompt itself (colocated, as the router routes new requests
  then): nothing has been sent yet;
- a retryable failure on D before it streamed anything (a transfer or checksum failure, a ticket gone stale,
  D unreachable, lost or silent, P lost while D pulls from it) releases the ticket and prefills again for a
  fresh ticket, on another P, and on another D when D itself failed that way or its pull failed or did not
  verify (the fault may be D's own: its memory, its network; a faulty D would fail every retry). The K/V
  depends on the prompt alone, so the first token already sent stays valid. When no prefill node is left, D
  goes on alone from that first token: a colocated continuation (below);
- once D has streamed tokens, losing it (unreachable or given up) migrates the request (proxy.routing.migration):
  another D continues it from the tokens sent so far, a colocated Generate of the prompt with them as output tokens;
  D's own errors then end the request with an error (never a replay of sent tokens).
Each attempt has its own request id on its node (the request's id, then `-retryN`), so that the abort sent to a
node the proxy gave up on (in the background, until the request's deadline: a frozen node that thaws frees the
request's blocks) never hits a later attempt there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc

from engine.types import FinishReason, PositionLogprobs, PromptLogprobs, SamplingParams
from node_common.tls import PLAINTEXT, ChannelSecurity
from proxy.routing.attempts import DEFAULT_ATTEMPT_TIMEOUT_S, AttemptAbandoned, AttemptLimits, Attempts, Retries
from proxy.routing.clients import DecodeClient, NodeError, PrefillClient, Prefilled
from proxy.routing.directory import NodeDirectory, NodeView
from proxy.routing.liveness import FAILED_CHECKS_TO_LOSE
from proxy.routing.migration import DecodeStreamBroken, Migrations
from proxy.routing.router import Mode, Route, Router, RouterConfig, RoutingPolicy
from wire import KVTicket, Role

logger = logging.getLogger(__name__)

RETRY_PAUSE_S = 0.5
# D's pull of the K/V failed (ABORTED) or the blocks it pulled did not verify (DATA_LOSS): retried on another pair
_PULL_FAILURES = (grpc.StatusCode.ABORTED, grpc.StatusCode.DATA_LOSS)
CLEANUP_TIMEOUT_S = 2.0  # an abort or release to a node that is up


@dataclass(frozen=True)
class TokenChunk:
    token_ids: list[int]
    logprobs: list[PositionLogprobs]
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    num_cached_tokens: int | None = None  # on the first chunk: the prefix hit of the node that prefilled
    # on the first chunk, when params.prompt_logprobs asked: vLLM's shape, None for position 0 then a dict per
    # prompt position (decoded_token left None), from the node that prefilled the prompt
    prompt_logprobs: PromptLogprobs | None = None


class PDPipeline:
    def __init__(self, directory: NodeDirectory, router: Router, max_retries: int = 2,
                 limits: AttemptLimits | None = None) -> None:
        self.directory = directory
        self.router = router
        self.max_retries = max_retries
        self.attempts = Attempts(directory.liveness, limits or AttemptLimits())
        self.migrations = Migrations(router)
        self._background: set[asyncio.Future[None]] = set()  # clean-up calls to nodes given up on

    # what /health reads: clients of the nodes that routing may use now
    @property
    def prefill_nodes(self) -> list[PrefillClient]:
        return [self.directory.prefill_client(n) for n in self.directory.nodes(Role.PREFILL)]

    @property
    def decode_nodes(self) -> list[DecodeClient]:
        return [self.directory.decode_client(n) for n in self.directory.nodes(Role.DECODE)]

    async def start(self) -> None:
        """Loads the node table and starts watching it (idempotent; `generate` calls it too)."""
        await self.directory.start()

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await self.directory.close()

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       deadline: float) -> AsyncGenerator[TokenChunk, None]:
        """Raises proxy.routing.errors.NoHealthyNodes / Overloaded before the first chunk, NodeError at any point."""
        await self.directory.start()
        route = self.router.route(prompt_token_ids)
        logger.debug("request %s: %s on %s%s (hit D %d, P %d tokens)", request_id, route.mode.value,
                     route.decode.node_id, f" after {route.prefill.node_id}" if route.prefill else "",
                     route.decode_hit_tokens, route.prefill_hit_tokens)
        retries = Retries(self.max_retries, request_id, self.attempts.counts.retries)
        first = (self._colocated(route.decode, prompt_token_ids, params, deadline, retries)
                 if route.mode is Mode.COLOCATED else
                 self._disaggregated(route, prompt_token_ids, params, deadline, retries))

        def resume(decode: NodeView, output_token_ids: list[int]) -> AsyncGenerator[TokenChunk, None]:
            return self._colocated(decode, prompt_token_ids, params, deadline, retries, output_token_ids)

        chunks = self.migrations.continued(first, retries, deadline, resume)
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield chunk

    async def _colocated(self, decode: NodeView, prompt_token_ids: list[int], params: SamplingParams,
                         deadline: float, retries: Retries, output_token_ids: Sequence[int] = ()
                         ) -> AsyncGenerator[TokenChunk, None]:
        """D prefills the prompt and streams every token; with `output_token_ids` (sent to the client already),
        D continues the request after them."""
        if output_token_ids:  # the prompt logprobs went out with the first chunk (and would cost D its prefix hits)
            params = dataclasses.replace(params, prompt_logprobs=None)
        tried: set[str] = set()
        finished = False
        attempt_id = retries.attempt_id(Role.DECODE)
        try:
            while True:
                started = False
                try:
                    stream = self.directory.decode_client(decode).generate(attempt_id, prompt_token_ids, params,
                                                                           None, deadline, output_token_ids)
                    with self.router.decoding(decode):
                        # D prefills the prompt itself: its first token takes a prefill's time
                        async for out in self.attempts.stream(decode, stream, self.attempts.limits.prefill_timeout_s):
                            if not started:
                                self.directory.mark_alive(decode)
                            started = True
                            finished = out.finish_reason is not None
                            # a continuation's prefix hit is not the prompt's: that was reported with the first token
                            yield TokenChunk(out.token_ids, out.logprobs, out.finish_reason, out.stop_token_id,
                                             None if output_token_ids else out.num_cached_tokens,
                                             out.prompt_logprobs)
                    return
                except NodeError as e:
                    failure = e
                self._note_failure(decode, failure)
                tried.add(decode.address)
                if started:  # the tokens sent stay sent: it continues elsewhere or fails (routing.migration)
                    raise DecodeStreamBroken(decode, failure)
                # only a D unreachable, lost or silent is worth leaving; its other errors would repeat elsewhere
                other = self.router.another_decode(tried) if failure.try_another_node else None
                if not failure.retryable or other is None or not retries.spend(failure):
                    raise failure
                await self._abort_abandoned(decode, attempt_id, failure, deadline)
                logger.warning("request %s: %s; running it on %s instead", retries.request_id, failure,
                               other.node_id)
                decode, attempt_id = other, retries.attempt_id(Role.DECODE)
        finally:
            if not finished:  # client gone, deadline or error: stop D's work
                await asyncio.shield(self._abort(decode, attempt_id, deadline))

    async def _disaggregated(self, route: Route, prompt_token_ids: list[int], params: SamplingParams,
                             deadline: float, retries: Retries) -> AsyncGenerator[TokenChunk, None]:
        assert route.prefill is not None, "a disaggregated route has a prefill node"
        decode = route.decode
        tried_prefill: set[str] = set()
        got = await self._prefill_on_any(route, decode, route.prefill, prompt_token_ids, params, deadline, retries,
                                         tried_prefill)
        if got is None:  # no prefill node can be reached: D prefills it itself (nothing was sent yet)
            logger.warning("request %s: no prefill node can be reached; %s prefills it", retries.request_id,
                           decode.node_id)
            async with contextlib.aclosing(self._colocated(decode, prompt_token_ids, params, deadline,
                                                           retries)) as chunks:
                async for chunk in chunks:
                    yield chunk
            return
        holder, prefilled = got
        held = prefilled.ticket  # pinned on `holder` until released
        # the prompt logprobs go out with the first chunk: not again from D, nor from a prefill again
        params = dataclasses.replace(params, prompt_logprobs=None)
        finished = prefilled.finish_reason is not None or prefilled.ticket is None
        attempt_id = retries.attempt_id(Role.DECODE)
        try:
            # inside the try: a client gone right after the first token still releases the ticket
            first_logprobs = [prefilled.first_logprobs] if prefilled.first_logprobs else []
            yield TokenChunk([prefilled.first_token], first_logprobs, prefilled.finish_reason,
                             num_cached_tokens=prefilled.num_cached_tokens, prompt_logprobs=prefilled.prompt_logprobs)
            if finished:
                return
            while True:
                started = False
                try:
                    stream = self.directory.decode_client(decode).generate(attempt_id, prompt_token_ids, params,
                                                                           prefilled, deadline)
                    with self.router.decoding(decode):
                        # until its first token D depends on `holder` too: it pulls the K/V from there
                        async for out in self.attempts.stream(decode, stream,
                                                              self.attempts.limits.first_token_timeout_s, holder):
                            if not started:
                                self.directory.mark_alive(decode)
                            started = True
                            finished = out.finish_reason is not None
                            yield TokenChunk(out.token_ids, out.logprobs, out.finish_reason, out.stop_token_id)
                    return
                except NodeError as e:
                    failure = e
                # an attempt given up because P was lost leaves D in place (only the abandonment names P)
                failed = holder if failure.role == Role.PREFILL.value else decode
                self._note_failure(failed, failure)
                if started:  # the tokens sent stay sent: it continues elsewhere or fails (routing.migration)
                    raise DecodeStreamBroken(decode, failure)
                if not failure.retryable or not retries.spend(failure):
                    raise failure
                await self._abort_abandoned(decode, attempt_id, failure, deadline)
                # the ticket is spent or stale: give it back, prefill again for a fresh one
                assert held is not None, "an unfinished prefill hands out a ticket"
                await self._release(holder, held, deadline)
                held = None
                if failed is decode and (failure.try_another_node or failure.code in _PULL_FAILURES):
                    other_decode = self.router.another_decode({decode.address}) or decode
                    await _pause_if_same(decode, other_decode, retries.used)
                    decode = other_decode
                attempt_id = retries.attempt_id(Role.DECODE)
                tried_prefill.add(holder.address)
                logger.warning("request %s: %s; prefilling again for %s", retries.request_id, failure,
                               decode.node_id)
                got = await self._prefill_on_any(route, decode, None, prompt_token_ids, params, deadline, retries,
                                                 tried_prefill)
                if got is None:
                    break
                holder, again = got
                if again.ticket is None:
                    raise failure
                prefilled = Prefilled(prefilled.first_token, prefilled.first_logprobs, None,
                                      prefilled.num_cached_tokens, again.ticket)
                held = again.ticket
            # no prefill node can be reached: D goes on alone from the prompt and the first token already sent
            logger.warning("request %s: no prefill node can be reached; %s continues it alone", retries.request_id,
                           decode.node_id)
            finished = True  # the colocated stream cleans up after itself
            async with contextlib.aclosing(self._colocated(decode, prompt_token_ids, params, deadline, retries,
                                                           [prefilled.first_token])) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            if not finished:
                # client gone, deadline or error: stop D's work and free P's pinned blocks
                await asyncio.shield(self._clean_up(decode, attempt_id, holder, held, deadline))

    async def _prefill_on_any(self, route: Route, decode: NodeView, first: NodeView | None,
                              prompt_token_ids: list[int], params: SamplingParams, deadline: float,
                              retries: Retries, tried: set[str]) -> tuple[NodeView, Prefilled] | None:
        """Prefills on `first` (None: the best P for `decode`), then on others while the failures are retryable
        and retries are left. None when no prefill node is left to try: every one is unreachable or gone."""
        node = first or self.router.another_prefill(route, decode, tried)
        while node is not None:
            attempt_id = retries.attempt_id(Role.PREFILL)
            try:
                return node, await self._prefill(node, attempt_id, prompt_token_ids, params, deadline)
            except NodeError as e:
                failure = e
            self._note_failure(node, failure)
            await self._abort_abandoned(node, attempt_id, failure, deadline)
            tried.add(node.address)
            if not failure.retryable:
                raise failure
            other = self.router.another_prefill(route, decode, tried)
            if other is None:
                return None
            if not retries.spend(failure):
                raise failure
            logger.warning("request %s: %s; prefilling on %s instead", retries.request_id, failure, other.node_id)
            await _pause_if_same(node, other, retries.used)
            node = other
        return None

    async def _prefill(self, node: NodeView, attempt_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       deadline: float) -> Prefilled:
        client = self.directory.prefill_client(node)
        with self.router.prefilling(node, len(prompt_token_ids)):
            try:
                prefilled = await self.attempts.unary(
                    node, client.prefill(attempt_id, prompt_token_ids, params, deadline),
                    self.attempts.limits.prefill_timeout_s)
            except asyncio.CancelledError:
                # the client went away mid-prefill: P may already hold (or be about to pin) blocks for it
                await asyncio.shield(self._abort(node, attempt_id, deadline))
                raise
        self.directory.mark_alive(node)
        return prefilled

    def _note_failure(self, node: NodeView, failure: NodeError) -> None:
        if failure.unreachable:
            self.directory.mark_down(node)

    # ---- clean-up calls (shield them from a cancelled request: they must go out all the same) ----
    async def _clean_up(self, decode: NodeView, attempt_id: str, holder: NodeView, ticket: KVTicket | None,
                        deadline: float) -> None:
        await self._abort(decode, attempt_id, deadline)
        if ticket is not None:
            await self._release(holder, ticket, deadline)

    async def _abort_abandoned(self, node: NodeView, attempt_id: str, failure: NodeError, deadline: float) -> None:
        """A node that failed an attempt has ended it itself; one running an attempt the proxy gave up on (for its
        own sake, or for the prefill node it pulls from) may still run it."""
        if isinstance(failure, AttemptAbandoned):
            await self._abort(node, attempt_id, deadline)

    async def _abort(self, node: NodeView, attempt_id: str, deadline: float) -> None:
        client = (self.directory.prefill_client(node) if node.role is Role.PREFILL
                  else self.directory.decode_client(node))
        await self._tell(node, lambda timeout: client.abort(attempt_id, timeout), deadline)

    async def _release(self, node: NodeView, ticket: KVTicket, deadline: float) -> None:
        client = self.directory.prefill_client(node)
        await self._tell(node, lambda timeout: client.release(ticket, timeout), deadline)

    async def _tell(self, node: NodeView, call: Callable[[float], Awaitable[None]], deadline: float) -> None:
        """Makes a clean-up call (abort, release) to `node`: awaited while the node is up. A node given up on gets
        it in the background, with until the request's deadline to answer: nobody waits for a frozen node, and one
        that thaws still frees what it held for the request (its cancelled RPC may have finished before it saw the
        cancellation)."""
        if not self.directory.is_down(node):
            await call(CLEANUP_TIMEOUT_S)
            return
        task = asyncio.ensure_future(call(max(CLEANUP_TIMEOUT_S, deadline - time.time())))
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def _pause_if_same(failed: NodeView, chosen: NodeView, retries: int) -> None:
    """Before retrying on the node that just failed (no other could take it): a restarting node needs a moment,
    and its channel retries the connection within a second."""
    if chosen.address == failed.address:
        await asyncio.sleep(RETRY_PAUSE_S * retries)


def add_routing_args(parser: argparse.ArgumentParser) -> None:
    """The proxy's flags for where nodes are and how requests are routed to them."""
    parser.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT",
                        help="a prefill node (repeatable; combinable with --registry)")
    parser.add_argument("--decode", action="append", default=[], metavar="HOST:PORT",
                        help="a decode node (repeatable; combinable with --registry)")
    parser.add_argument("--registry", default=None, metavar="redis://HOST:PORT",
                        help="discover nodes (and their KV events) in this Redis")
    parser.add_argument("--routing", default=RoutingPolicy.PREFIX_LOAD.value,
                        choices=[p.value for p in RoutingPolicy],
                        help="prefix_load: prefix hits and load, colocating short prompts on D; round_robin: nodes "
                             "in turn, always disaggregated")
    parser.add_argument("--colocate-max-tokens", type=int, default=RouterConfig.colocate_max_tokens,
                        help="uncached prompt tokens an idle decode node prefills itself (0: always disaggregate)")
    parser.add_argument("--max-retries", type=int, default=2,
                        help="failed or abandoned attempts retried per request, on other nodes")
    parser.add_argument("--health-check-interval", type=float, default=1.0, metavar="SECONDS",
                        help="seconds between health checks of the static nodes, and of registered nodes while "
                             "requests are in flight on them")
    parser.add_argument("--health-check-timeout", type=float, default=1.0, metavar="SECONDS",
                        help="a node that does not answer Health within this long fails the check; after "
                             f"{FAILED_CHECKS_TO_LOSE} failed checks in a row the proxy gives it up and retries the "
                             "requests in flight there elsewhere")
    parser.add_argument("--prefill-attempt-timeout", type=float, default=DEFAULT_ATTEMPT_TIMEOUT_S,
                        metavar="SECONDS", help="a Prefill (or a colocated request's first token) not answered "
                                            "within this long is retried elsewhere (0: no limit)")
    parser.add_argument("--decode-first-token-timeout", type=float, default=DEFAULT_ATTEMPT_TIMEOUT_S,
                        metavar="SECONDS", help="a decode node that has not streamed a handed-off request's first "
                                            "token within this long is given up for it (0: no limit)")


def pipeline_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace,
                       security: ChannelSecurity = PLAINTEXT) -> PDPipeline:
    if not args.registry and not args.decode:
        parser.error("give --registry redis://HOST:PORT, or the nodes with --decode HOST:PORT (and --prefill)")
    if args.block_size <= 0 or args.colocate_max_tokens < 0 or args.max_retries < 0:
        parser.error("--block-size must be positive, --colocate-max-tokens and --max-retries not negative")
    if args.health_check_interval <= 0 or args.health_check_timeout <= 0:
        parser.error("--health-check-interval and --health-check-timeout must be positive")
    if args.prefill_attempt_timeout < 0 or args.decode_first_token_timeout < 0:
        parser.error("--prefill-attempt-timeout and --decode-first-token-timeout must not be negative")
    try:
        directory = NodeDirectory(args.prefill, args.decode, args.registry, block_size=args.block_size,
                                  hash_seed=args.hash_seed, health_interval_s=args.health_check_interval,
                                  health_timeout_s=args.health_check_timeout, security=security)
    except ValueError as e:
        parser.error(str(e))
    config = RouterConfig(policy=RoutingPolicy(args.routing), block_size=args.block_size, hash_seed=args.hash_seed,
                          colocate_max_tokens=args.colocate_max_tokens)
    limits = AttemptLimits(prefill_timeout_s=args.prefill_attempt_timeout or None,
                           first_token_timeout_s=args.decode_first_token_timeout or None)
    return PDPipeline(directory, Router(directory, config), max_retries=args.max_retries, limits=limits)
