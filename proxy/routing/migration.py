"""Decode migration: a request whose decode node is lost after it streamed tokens goes on on another one.

When D dies (its stream breaks: unreachable) or the proxy gives it up (frozen: proxy.routing.liveness,
proxy.routing.attempts)
after it has streamed tokens, the client keeps what it got and the request continues on another decode node. (A
draining node finishes its streams, node_common.server; one that its drain timeout cuts off breaks the same way.)
The continuation is a colocated Generate of the original prompt with the tokens already sent as
`output_token_ids`: the new D computes prompt + those tokens in one prefill and streams only the tokens after
them. The engine counts them as the request's output, not as prompt (engine.llm_engine.make_request), so the
continuation is the same request:
- max_tokens and min_tokens count from the request's start: no sampling parameter is adjusted;
- greedy output is that of an undisturbed run (as after a P/D handoff, up to float rounding: the new node
  computes in one prefill the K/V that the old one built step by step). So is seeded sampling (an explicit
  `seed`): the noise of output token k depends on (seed, k) alone (engine/sampler.py), and presence and frequency
  penalties see the tokens as output, as they would have. Without a seed each node draws its own, as P and D do;
- stop strings and the text are the proxy's (engine.output_processor, one per choice in proxy.api.serving): it sees
  one continuous stream of token ids, so a stop string spanning the tokens of both nodes is found, its holdback
  included. EOS and stop token ids are token-level and apply on the new node as they did on the old one;
- logprobs come with each token from the node that sampled it; usage counts each token once (prompt_tokens is
  the original prompt's, and the new node's prefix hit is not reported again: proxy.routing.pd).

Why colocated, not a handoff from a prefill node: a migration is a repair of a stream already under way, where
what counts is the gap the client sees. One RPC to one node is the shortest path (a handoff adds a Prefill, a
ticket, a transfer and a release, and a second node whose failure the repair would then depend on), it works
when no prefill node is left, and only the decode protocol needs to carry the output tokens. The price is a
prefill of prompt + output on D, in its batches; migrations are rare, so that is accepted.

Bounds: each migration takes one of the request's retries (`max_retries`, shared with every other retry); none
starts past the request's deadline, and the new node gets the same deadline. With no other decode node, no retry
left or the deadline passed, the stream ends with the node's error, as without migration. A failure that is the
node's own error (not a lost node) would repeat elsewhere: it ends the stream too, uncounted.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING

from proxy.routing.attempts import Retries
from proxy.routing.clients import NodeError
from proxy.routing.directory import NodeView
from proxy.routing.router import Router

if TYPE_CHECKING:
    from proxy.routing.pd import TokenChunk

logger = logging.getLogger(__name__)


class DecodeStreamBroken(Exception):
    """A decode node failed a request after it had streamed tokens (raised by proxy.routing.pd, handled here)."""

    def __init__(self, node: NodeView, failure: NodeError) -> None:
        super().__init__(str(failure))
        self.node = node
        self.failure = failure


class MigrationOutcome(enum.Enum):
    MIGRATED = "migrated"  # the request went on on another decode node
    NO_DECODE_NODE = "no_decode_node"
    NO_RETRY_LEFT = "no_retry_left"
    PAST_DEADLINE = "past_deadline"


# The stream of the request's continuation on a decode node, after the tokens already sent
Resume = Callable[[NodeView, list[int]], AsyncGenerator["TokenChunk", None]]


class Migrations:
    """Continues requests whose decode node was lost mid-stream; `counts`: by MigrationOutcome value (/metrics)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.counts: Counter[str] = Counter()

    async def continued(self, chunks: AsyncGenerator[TokenChunk, None], retries: Retries, deadline: float,
                        resume: Resume) -> AsyncGenerator[TokenChunk, None]:
        """The chunks of `chunks`, and when their decode node is lost after streaming, those of `resume` on
        another one from the tokens sent so far, as often as the request's retries allow. What was yielded is
        what the client got: the continuation starts right after it, so no token is repeated or left out."""
        sent: list[int] = []
        tried: set[str] = set()
        while True:
            try:
                async with contextlib.aclosing(chunks):
                    async for chunk in chunks:
                        sent.extend(chunk.token_ids)
                        yield chunk
                return
            except DecodeStreamBroken as broken:
                tried.add(broken.node.address)
                target = self._target(broken, retries, deadline, tried, len(sent))
                if target is None:
                    raise broken.failure from None
                chunks = resume(target, list(sent))

    def _target(self, broken: DecodeStreamBroken, retries: Retries, deadline: float, tried: set[str],
                num_sent: int) -> NodeView | None:
        """The decode node to continue on (a retry spent), or None: the stream ends with the failure."""
        failure = broken.failure
        if not failure.try_another_node:  # the node's own error, not a lost node: it would repeat elsewhere
            return None
        target = None
        if time.time() >= deadline:
            outcome = MigrationOutcome.PAST_DEADLINE
        elif (target := self.router.another_decode(tried)) is None:
            outcome = MigrationOutcome.NO_DECODE_NODE
        elif not retries.spend(failure):
            outcome, target = MigrationOutcome.NO_RETRY_LEFT, None
        else:
            outcome = MigrationOutcome.MIGRATED
        self.counts[outcome.value] += 1
        if target is not None:
            logger.info("request %s: decode node %s lost after %d tokens (%s); continuing on %s", retries.request_id,
                        broken.node.node_id, num_sent, failure.message, target.node_id)
        else:
            logger.info("request %s: decode node %s lost after %d tokens (%s); not migrated: %s",
                        retries.request_id, broken.node.node_id, num_sent, failure.message, outcome.value)
        return target
