"""One request's path through the cluster, as a stream of token chunks.

The router picks D, the mode and P (proxy/router.py).
- Colocated: D prefills the prompt itself and streams every token.
- Disaggregated: P computes the prompt's K/V and the first token; the first token goes to the client at once;
  D pulls the K/V and streams the rest.
Failures, at most `max_retries` retries per request in all:
- a node that a call finds unreachable is marked down in the directory (proxy.dead_nodes): routing leaves it
  out for a short back-off, so the requests after this one do not try it first;
- a retryable prefill failure runs the prefill again on another P (the same one only when no other can). When
  no prefill node is left at all, D prefills the prompt itself (colocated, as the router routes new requests
  then): nothing has been sent yet;
- a retryable failure on D before it streamed anything (a transfer or checksum failure, a ticket gone stale,
  D unreachable) releases the ticket and prefills again for a fresh ticket, on another P, and on another D
  when D was unreachable. The K/V depends on the prompt alone, so the first token already sent stays valid.
  When no prefill node is left, D goes on alone: a colocated request of the prompt + that first token, with
  one token fewer to generate (greedy output is unchanged; presence and frequency penalties see that token
  as prompt);
- once D has streamed tokens, a failure ends the request with an error (never a replay of sent tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import grpc

from engine.types import FinishReason, PositionLogprobs, SamplingParams
from proxy.clients import DecodeClient, NodeError, PrefillClient, Prefilled
from proxy.directory import NodeDirectory, NodeView
from proxy.router import Mode, Route, Router, RouterConfig, RoutingPolicy
from wire import KVTicket, Role

logger = logging.getLogger(__name__)

RETRY_PAUSE_S = 0.5


@dataclass(frozen=True)
class TokenChunk:
    token_ids: list[int]
    logprobs: list[PositionLogprobs]
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    num_cached_tokens: int | None = None  # on the first chunk: the prefix hit of the node that prefilled


class PDPipeline:
    def __init__(self, directory: NodeDirectory, router: Router, max_retries: int = 2) -> None:
        self.directory = directory
        self.router = router
        self.max_retries = max_retries

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
        await self.directory.close()

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       deadline: float) -> AsyncGenerator[TokenChunk, None]:
        """Raises proxy.errors.NoHealthyNodes / Overloaded before the first chunk, NodeError at any point."""
        await self.directory.start()
        route = self.router.route(prompt_token_ids)
        logger.debug("request %s: %s on %s%s (hit D %d, P %d tokens)", request_id, route.mode.value,
                     route.decode.node_id, f" after {route.prefill.node_id}" if route.prefill else "",
                     route.decode_hit_tokens, route.prefill_hit_tokens)
        retries = _Retries(self.max_retries)
        chunks = (self._colocated(route.decode, request_id, prompt_token_ids, params, deadline, retries)
                  if route.mode is Mode.COLOCATED else
                  self._disaggregated(route, request_id, prompt_token_ids, params, deadline, retries))
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield chunk

    async def _colocated(self, decode: NodeView, request_id: str, prompt_token_ids: list[int],
                         params: SamplingParams, deadline: float, retries: _Retries
                         ) -> AsyncGenerator[TokenChunk, None]:
        tried: set[str] = set()
        finished = False
        try:
            while True:
                started = False
                try:
                    with self.router.decoding(decode):
                        async for out in self.directory.decode_client(decode).generate(
                                request_id, prompt_token_ids, params, None, deadline):
                            if not started:
                                self.directory.mark_alive(decode)
                            started = True
                            finished = out.finish_reason is not None
                            yield TokenChunk(out.token_ids, out.logprobs, out.finish_reason, out.stop_token_id,
                                             out.num_cached_tokens)
                    return
                except NodeError as e:
                    failure = e
                self._note_failure(decode, failure)
                tried.add(decode.address)
                # only an unreachable D is worth leaving; its other errors would repeat elsewhere
                other = self.router.another_decode(tried) if failure.code == grpc.StatusCode.UNAVAILABLE else None
                if started or not failure.retryable or other is None or not retries.spend():
                    raise failure
                logger.warning("request %s: %s; running it on %s instead", request_id, failure, other.node_id)
                decode = other
        finally:
            if not finished:  # client gone, deadline or error: stop D's work
                await asyncio.shield(self.directory.decode_client(decode).abort(request_id))

    async def _disaggregated(self, route: Route, request_id: str, prompt_token_ids: list[int],
                             params: SamplingParams, deadline: float, retries: _Retries
                             ) -> AsyncGenerator[TokenChunk, None]:
        assert route.prefill is not None, "a disaggregated route has a prefill node"
        decode = route.decode
        tried_prefill: set[str] = set()
        got = await self._prefill_on_any(route, decode, route.prefill, request_id, prompt_token_ids, params,
                                         deadline, retries, tried_prefill)
        if got is None:  # no prefill node can be reached: D prefills it itself (nothing was sent yet)
            logger.warning("request %s: no prefill node can be reached; %s prefills it", request_id, decode.node_id)
            async with contextlib.aclosing(self._colocated(decode, request_id, prompt_token_ids, params, deadline,
                                                           retries)) as chunks:
                async for chunk in chunks:
                    yield chunk
            return
        holder, prefilled = got
        held = prefilled.ticket  # pinned on `holder` until released
        finished = prefilled.finish_reason is not None or prefilled.ticket is None
        try:
            # inside the try: a client gone right after the first token still releases the ticket
            first_logprobs = [prefilled.first_logprobs] if prefilled.first_logprobs else []
            yield TokenChunk([prefilled.first_token], first_logprobs, prefilled.finish_reason,
                             num_cached_tokens=prefilled.num_cached_tokens)
            if finished:
                return
            while True:
                started = False
                try:
                    with self.router.decoding(decode):
                        async for out in self.directory.decode_client(decode).generate(
                                request_id, prompt_token_ids, params, prefilled, deadline):
                            if not started:
                                self.directory.mark_alive(decode)
                            started = True
                            finished = out.finish_reason is not None
                            yield TokenChunk(out.token_ids, out.logprobs, out.finish_reason, out.stop_token_id)
                    return
                except NodeError as e:
                    failure = e
                self._note_failure(decode, failure)
                if started or not failure.retryable or not retries.spend():
                    raise failure
                # the ticket is spent or stale: give it back, prefill again for a fresh one
                assert held is not None, "an unfinished prefill hands out a ticket"
                await self.directory.prefill_client(holder).release(held)
                held = None
                if failure.code == grpc.StatusCode.UNAVAILABLE:  # D itself is unreachable
                    other_decode = self.router.another_decode({decode.address}) or decode
                    await _pause_if_same(decode, other_decode, retries.used)
                    decode = other_decode
                tried_prefill.add(holder.address)
                logger.warning("request %s: %s; prefilling again for %s", request_id, failure, decode.node_id)
                got = await self._prefill_on_any(route, decode, None, f"{request_id}-retry{retries.used}",
                                                 prompt_token_ids, params, deadline, retries, tried_prefill)
                if got is None:
                    break
                holder, again = got
                if again.ticket is None:
                    raise failure
                prefilled = Prefilled(prefilled.first_token, prefilled.first_logprobs, None,
                                      prefilled.num_cached_tokens, again.ticket)
                held = again.ticket
            # no prefill node can be reached: D goes on alone from the prompt and the first token already sent
            logger.warning("request %s: no prefill node can be reached; %s continues it alone", request_id,
                           decode.node_id)
            finished = True  # the colocated stream cleans up after itself
            rest = dataclasses.replace(params, min_tokens=max(0, params.min_tokens - 1),
                                       max_tokens=None if params.max_tokens is None else params.max_tokens - 1)
            async with contextlib.aclosing(self._colocated(decode, request_id, [*prompt_token_ids,
                                                                                prefilled.first_token],
                                                           rest, deadline, retries)) as chunks:
                async for chunk in chunks:
                    yield dataclasses.replace(chunk, num_cached_tokens=None)
        finally:
            if not finished:
                # client gone, deadline or error: stop D's work and free P's pinned blocks
                await asyncio.shield(_cleanup(self.directory.decode_client(decode),
                                              self.directory.prefill_client(holder), request_id, held))

    async def _prefill_on_any(self, route: Route, decode: NodeView, first: NodeView | None, request_id: str,
                              prompt_token_ids: list[int], params: SamplingParams, deadline: float,
                              retries: _Retries, tried: set[str]) -> tuple[NodeView, Prefilled] | None:
        """Prefills on `first` (None: the best P for `decode`), then on others while the failures are retryable
        and retries are left. None when no prefill node is left to try: every one is unreachable or gone."""
        node = first or self.router.another_prefill(route, decode, tried)
        while node is not None:
            try:
                return node, await self._prefill(node, request_id, prompt_token_ids, params, deadline)
            except NodeError as e:
                failure = e
            self._note_failure(node, failure)
            tried.add(node.address)
            if not failure.retryable:
                raise failure
            other = self.router.another_prefill(route, decode, tried)
            if other is None:
                return None
            if not retries.spend():
                raise failure
            logger.warning("request %s: %s; prefilling on %s instead", request_id, failure, other.node_id)
            await _pause_if_same(node, other, retries.used)
            node = other
        return None

    async def _prefill(self, node: NodeView, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       deadline: float) -> Prefilled:
        client = self.directory.prefill_client(node)
        with self.router.prefilling(node, len(prompt_token_ids)):
            try:
                prefilled = await client.prefill(request_id, prompt_token_ids, params, deadline)
            except asyncio.CancelledError:
                # the client went away mid-prefill: P may already hold (or be about to pin) blocks for it
                await asyncio.shield(client.abort(request_id))
                raise
        self.directory.mark_alive(node)
        return prefilled

    def _note_failure(self, node: NodeView, failure: NodeError) -> None:
        if failure.unreachable:
            self.directory.mark_down(node)


@dataclass
class _Retries:
    """A request's retries, shared by its prefill and decode attempts."""

    limit: int
    used: int = 0

    def spend(self) -> bool:
        """Takes one retry; False when none is left."""
        if self.used >= self.limit:
            return False
        self.used += 1
        return True


async def _pause_if_same(failed: NodeView, chosen: NodeView, retries: int) -> None:
    """Before retrying on the node that just failed (no other could take it): a restarting node needs a moment,
    and its channel retries the connection within a second."""
    if chosen.address == failed.address:
        await asyncio.sleep(RETRY_PAUSE_S * retries)


async def _cleanup(decode: DecodeClient, prefill: PrefillClient, request_id: str, ticket: KVTicket | None) -> None:
    await decode.abort(request_id)
    if ticket is not None:
        await prefill.release(ticket)


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
                        help="prefill/transfer failures retried per request, on other nodes")


def pipeline_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> PDPipeline:
    if not args.registry and not args.decode:
        parser.error("give --registry redis://HOST:PORT, or the nodes with --decode HOST:PORT (and --prefill)")
    if args.block_size <= 0 or args.colocate_max_tokens < 0 or args.max_retries < 0:
        parser.error("--block-size must be positive, --colocate-max-tokens and --max-retries not negative")
    try:
        directory = NodeDirectory(args.prefill, args.decode, args.registry, block_size=args.block_size,
                                  hash_seed=args.hash_seed)
    except ValueError as e:
        parser.error(str(e))
    config = RouterConfig(policy=RoutingPolicy(args.routing), block_size=args.block_size, hash_seed=args.hash_seed,
                          colocate_max_tokens=args.colocate_max_tokens)
    return PDPipeline(directory, Router(directory, config), max_retries=args.max_retries)
