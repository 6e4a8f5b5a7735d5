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

The policy is a state machine, its states, events and transitions in proxy.routing.pd_states; this module does its I/O.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

from engine.types import FinishReason, PositionLogprobs, PromptLogprobs, SamplingParams
from node_common.tls import PLAINTEXT, ChannelSecurity
from node_common.tracing import NO_TRACER, Tracer
from proxy.routing.attempts import DEFAULT_ATTEMPT_TIMEOUT_S, AttemptLimits, Attempts, Retries
from proxy.routing.cleanup import CleanupCalls
from proxy.routing.clients import DecodeClient, NodeError, PrefillClient, Prefilled
from proxy.routing.directory import NodeDirectory, NodeView
from proxy.routing.liveness import FAILED_CHECKS_TO_LOSE
from proxy.routing.migration import DecodeStreamBroken, Migrations
from proxy.routing.pd_states import LOOKING_FOR_PREFILL, Action, Event, State, Transition, failure_event, next_state
from proxy.routing.phases import Phases
from proxy.routing.router import Mode, Route, Router, RouterConfig, RoutingPolicy
from wire import Role

logger = logging.getLogger(__name__)

RETRY_PAUSE_S = 0.5


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
                 limits: AttemptLimits | None = None, tracer: Tracer = NO_TRACER) -> None:
        self.directory = directory
        self.phases = Phases(tracer)  # where requests' time goes: spans, and the nodes' timings to the metrics
        self.router = router
        self.max_retries = max_retries
        self.attempts = Attempts(directory.liveness, limits or AttemptLimits())
        self.migrations = Migrations(router)
        self.cleanup = CleanupCalls(directory)  # shield its calls from a cancelled request: they must go out

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
        self.cleanup.cancel()
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
        routed = Event.ROUTED_COLOCATED if route.mode is Mode.COLOCATED else Event.ROUTED_DISAGGREGATED
        first = (self._colocated(route.decode, prompt_token_ids, params, deadline, retries)
                 if _step(State.ROUTING, routed, retries).state is State.COLOCATED else
                 self._disaggregated(route, prompt_token_ids, params, deadline, retries))

        def resume(decode: NodeView, output_token_ids: list[int]) -> AsyncGenerator[TokenChunk, None]:
            return self._colocated(decode, prompt_token_ids, params, deadline, retries, output_token_ids)

        chunks = self.migrations.continued(first, retries, deadline, resume)
        with self.phases.request(request_id, len(prompt_token_ids)) as span:
            span.set_attributes({"tandem.mode": route.mode.value})
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    yield chunk

    async def _colocated(self, decode: NodeView, prompt_token_ids: list[int], params: SamplingParams,
                         deadline: float, retries: Retries, output_token_ids: Sequence[int] = ()
                         ) -> AsyncGenerator[TokenChunk, None]:
        """State COLOCATED: D prefills the prompt and streams every token; with `output_token_ids` (sent to the
        client already), D continues the request after them."""
        if output_token_ids:  # the prompt logprobs went out with the first chunk (and would cost D its prefix hits)
            params = dataclasses.replace(params, prompt_logprobs=None)
        tried: set[str] = set()
        finished = False
        attempt_id = retries.attempt_id(Role.DECODE)
        state = State.COLOCATED
        try:
            while state is State.COLOCATED:
                started = False
                try:
                    span = self.phases.attempt(retries.request_id, Role.DECODE, decode, attempt_id)
                    stream = self.phases.decoded(span, self.directory.decode_client(decode).generate(
                        attempt_id, prompt_token_ids, params, None, deadline, output_token_ids, span.metadata()))
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
                    state = _step(state, Event.FINISHED, retries).state
                    continue
                except NodeError as e:
                    failure = e
                self._note_failure(decode, failure)
                tried.add(decode.address)
                step = _step(state, failure_event(failure, Role.DECODE, started), retries)
                if step.action is Action.MIGRATE:  # the tokens sent stay sent: it continues elsewhere or fails
                    raise DecodeStreamBroken(decode, failure)
                if step.action is Action.FAIL:
                    raise failure
                other = self.router.another_decode(tried)  # FIND_DECODE
                step = _step(step.state, Event.NO_NODE_LEFT if other is None else Event.NODE_FOUND, retries)
                if step.action is Action.FAIL:
                    raise failure
                spent = other is not None and retries.spend(failure)
                assert spent and other is not None, "a retry was left for another decode node"
                await self.cleanup.abort_abandoned(decode, attempt_id, failure, deadline)
                logger.warning("request %s: %s; running it on %s instead", retries.request_id, failure,
                               other.node_id)
                decode, attempt_id, state = other, retries.attempt_id(Role.DECODE), step.state
        finally:
            if not finished:  # client gone, deadline or error: stop D's work
                await asyncio.shield(self.cleanup.abort(decode, attempt_id, deadline))

    async def _disaggregated(self, route: Route, prompt_token_ids: list[int], params: SamplingParams,
                             deadline: float, retries: Retries) -> AsyncGenerator[TokenChunk, None]:
        """From PREFILLING: the first token from P, then D (`_handed_off`); D alone when no P can be reached."""
        assert route.prefill is not None, "a disaggregated route has a prefill node"
        tried_prefill: set[str] = set()
        step, got = await self._prefill_on_any(State.PREFILLING, route.prefill, route, route.decode,
                                               prompt_token_ids, params, deadline, retries, tried_prefill)
        if got is None:  # PREFILL_ON_DECODE: no prefill node can be reached and nothing was sent yet
            logger.warning("request %s: no prefill node can be reached; %s prefills it", retries.request_id,
                           route.decode.node_id)
            chunks = self._colocated(route.decode, prompt_token_ids, params, deadline, retries)
        else:  # the prompt logprobs go out with the first chunk: not again from D, nor from a prefill again
            params = dataclasses.replace(params, prompt_logprobs=None)
            chunks = self._handed_off(step.state, *got, route, prompt_token_ids, params, deadline, retries,
                                      tried_prefill)
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield chunk

    async def _handed_off(self, state: State, holder: NodeView, prefilled: Prefilled, route: Route,
                          prompt_token_ids: list[int], params: SamplingParams, deadline: float, retries: Retries,
                          tried_prefill: set[str]) -> AsyncGenerator[TokenChunk, None]:
        """From SEND_FIRST_TOKEN (`state` DECODING, or DONE when P's first token finished the request): D streams
        the rest, with a fresh ticket when D's attempt fails before it streamed (TICKET_LOST, PREFILLING_AGAIN),
        or goes on alone from the first token when no P is left."""
        decode = route.decode
        held = prefilled.ticket  # pinned on `holder` until released
        finished = state is State.DONE
        attempt_id = retries.attempt_id(Role.DECODE)
        try:
            # inside the try: a client gone right after the first token still releases the ticket
            first_logprobs = [prefilled.first_logprobs] if prefilled.first_logprobs else []
            yield TokenChunk([prefilled.first_token], first_logprobs, prefilled.finish_reason,
                             num_cached_tokens=prefilled.num_cached_tokens, prompt_logprobs=prefilled.prompt_logprobs)
            while state is State.DECODING:
                started = False
                try:
                    span = self.phases.attempt(retries.request_id, Role.DECODE, decode, attempt_id)
                    stream = self.phases.decoded(span, self.directory.decode_client(decode).generate(
                        attempt_id, prompt_token_ids, params, prefilled, deadline, metadata=span.metadata()))
                    with self.router.decoding(decode):
                        # until its first token D depends on `holder` too: it pulls the K/V from there
                        async for out in self.attempts.stream(decode, stream,
                                                              self.attempts.limits.first_token_timeout_s, holder):
                            if not started:
                                self.directory.mark_alive(decode)
                            started = True
                            finished = out.finish_reason is not None
                            yield TokenChunk(out.token_ids, out.logprobs, out.finish_reason, out.stop_token_id)
                    state = _step(state, Event.FINISHED, retries).state
                    continue
                except NodeError as e:
                    failure = e
                # an attempt given up because P was lost leaves D in place (only the abandonment names P)
                self._note_failure(holder if failure.role == Role.PREFILL.value else decode, failure)
                step = _step(state, failure_event(failure, Role.DECODE, started), retries)
                if step.action is Action.MIGRATE:  # the tokens sent stay sent: it continues elsewhere or fails
                    raise DecodeStreamBroken(decode, failure)
                if step.action is Action.FAIL:
                    raise failure
                spent = retries.spend(failure)
                assert spent, "a retry was left to renew the ticket"
                await self.cleanup.abort_abandoned(decode, attempt_id, failure, deadline)
                # the ticket is spent or stale: give it back, prefill again for a fresh one
                assert held is not None, "an unfinished prefill hands out a ticket"
                await self.cleanup.release(holder, held, deadline)
                held = None
                if step.action is Action.RENEW_TICKET_ON_ANOTHER_DECODE:
                    other_decode = self.router.another_decode({decode.address}) or decode
                    await _pause_if_same(decode, other_decode, retries.used)
                    decode = other_decode
                attempt_id = retries.attempt_id(Role.DECODE)
                tried_prefill.add(holder.address)
                logger.warning("request %s: %s; prefilling again for %s", retries.request_id, failure,
                               decode.node_id)
                step, renewed = await self._prefill_on_any(step.state, None, route, decode, prompt_token_ids,
                                                           params, deadline, retries, tried_prefill)
                if step.action is Action.FAIL:  # the fresh first token finished the request: no ticket
                    raise failure
                state = step.state  # DECODING, or COLOCATED: no prefill node is left
                if renewed is not None:
                    holder, again = renewed
                    held = again.ticket
                    prefilled = Prefilled(prefilled.first_token, prefilled.first_logprobs, None,
                                          prefilled.num_cached_tokens, again.ticket)
            if state is State.COLOCATED:  # CONTINUE_ALONE: from the prompt and the first token already sent
                logger.warning("request %s: no prefill node can be reached; %s continues it alone",
                               retries.request_id, decode.node_id)
                finished = True  # the colocated stream cleans up after itself
                async with contextlib.aclosing(self._colocated(decode, prompt_token_ids, params, deadline, retries,
                                                               [prefilled.first_token])) as chunks:
                    async for chunk in chunks:
                        yield chunk
        finally:
            if not finished:
                # client gone, deadline or error: stop D's work and free P's pinned blocks
                await asyncio.shield(self.cleanup.clean_up(decode, attempt_id, holder, held, deadline))

    async def _prefill_on_any(self, state: State, node: NodeView | None, route: Route, decode: NodeView,
                              prompt_token_ids: list[int], params: SamplingParams, deadline: float,
                              retries: Retries, tried: set[str]
                              ) -> tuple[Transition, tuple[NodeView, Prefilled] | None]:
        """Runs the prefill states from `state`: PREFILLING on `node`, or TICKET_LOST (looking for a P, `node`
        None). Returns the transition out of them (to DECODING or DONE with the node that prefilled and its answer;
        to COLOCATED when no prefill node is left; to FAILED when a fresh first token finished the request) and
        raises the prefill failure that ends the request."""
        failure: NodeError | None = None
        while True:
            if state in LOOKING_FOR_PREFILL:
                other = self.router.another_prefill(route, decode, tried)
                step = _step(state, Event.NO_NODE_LEFT if other is None else Event.NODE_FOUND, retries)
                if step.action is Action.FAIL:
                    assert failure is not None, "only a prefill retry fails for want of a retry"
                    raise failure
                if other is None:
                    return step, None
                if step.action is Action.RETRY:
                    assert failure is not None and node is not None, "a prefill retry follows a failed prefill"
                    spent = retries.spend(failure)
                    assert spent, "a retry was left"
                    logger.warning("request %s: %s; prefilling on %s instead", retries.request_id, failure,
                                   other.node_id)
                    await _pause_if_same(node, other, retries.used)
                state, node = step.state, other
            assert node is not None, f"{state.value} runs on a prefill node"
            attempt_id = retries.attempt_id(Role.PREFILL)
            try:
                prefilled = await self._prefill(node, attempt_id, prompt_token_ids, params, deadline,
                                                retries.request_id)
            except NodeError as e:
                failure = e
            else:
                # a fresh ticket's first token stands for the one sent: only a missing ticket ends it there
                done = prefilled.ticket is None or (state is State.PREFILLING and prefilled.finish_reason is not None)
                return _step(state, Event.PREFILLED_FINISHED if done else Event.PREFILLED, retries), (node, prefilled)
            self._note_failure(node, failure)
            await self.cleanup.abort_abandoned(node, attempt_id, failure, deadline)
            tried.add(node.address)
            step = _step(state, failure_event(failure, Role.PREFILL, False), retries)
            if step.action is Action.FAIL:
                raise failure
            state = step.state

    async def _prefill(self, node: NodeView, attempt_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       deadline: float, request_id: str) -> Prefilled:
        client = self.directory.prefill_client(node)
        with self.router.prefilling(node, len(prompt_token_ids)):
            try:
                span = self.phases.attempt(request_id, Role.PREFILL, node, attempt_id)
                prefilled = await self.attempts.unary(node, self.phases.prefilled(
                    span, client.prefill(attempt_id, prompt_token_ids, params, deadline, span.metadata())),
                    self.attempts.limits.prefill_timeout_s)
            except asyncio.CancelledError:
                # the client went away mid-prefill: P may already hold (or be about to pin) blocks for it
                await asyncio.shield(self.cleanup.abort(node, attempt_id, deadline))
                raise
        self.directory.mark_alive(node)
        return prefilled

    def _note_failure(self, node: NodeView, failure: NodeError) -> None:
        if failure.unreachable:
            self.directory.mark_down(node)


def _step(state: State, event: Event, retries: Retries) -> Transition:
    """The policy's transition (proxy.routing.pd_states), with the retries the request has left."""
    return next_state(state, event, retries.limit - retries.used)


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
    parser.add_argument("--kv-host-hit-cost", type=float, default=RouterConfig.host_hit_cost, metavar="F",
                        help="a prefix hit in a node's host KV tier costs this fraction of computing its tokens "
                             "(it is copied back into the pool; 0 to 1)")
    parser.add_argument("--kv-store-hit-cost", type=float, default=RouterConfig.store_hit_cost, metavar="F",
                        help="a prefix hit in the cluster KV store costs this fraction of computing its tokens "
                             "(a network get, a host write and a copy; 0 to 1)")
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
                       security: ChannelSecurity = PLAINTEXT, tracer: Tracer = NO_TRACER) -> PDPipeline:
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
    try:
        config = RouterConfig(policy=RoutingPolicy(args.routing), block_size=args.block_size,
                              hash_seed=args.hash_seed, colocate_max_tokens=args.colocate_max_tokens,
                              host_hit_cost=args.kv_host_hit_cost, store_hit_cost=args.kv_store_hit_cost)
    except ValueError as e:
        parser.error(str(e))
    limits = AttemptLimits(prefill_timeout_s=args.prefill_attempt_timeout or None,
                           first_token_timeout_s=args.decode_first_token_timeout or None)
    return PDPipeline(directory, Router(directory, config), max_retries=args.max_retries, limits=limits, tracer=tracer)
