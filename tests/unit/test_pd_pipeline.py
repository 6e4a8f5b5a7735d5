"""The pipeline's failure handling with scripted nodes: prefill retried on another P, a failed handoff
prefilled again for a fresh ticket, no replay once D has streamed, cleanup when the client goes away, and
unreachable nodes left out of routing (the colocated fallback when no prefill node is left)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
import pytest

from engine.types import FinishReason, SamplingParams
from proxy.routing.clients import Decoded, NodeError, Prefilled
from proxy.routing.dead_nodes import DeadNodes
from proxy.routing.directory import NodeView
from proxy.routing.liveness import Liveness
from proxy.routing.pd import PDPipeline, TokenChunk
from proxy.routing.prefix_index import PrefixIndex
from proxy.routing.router import Router, RouterConfig
from wire import KVTicket, NodeCapacity, NodeLoad, Role

PROMPT = list(range(10, 210))  # long enough to be disaggregated
PARAMS = SamplingParams(max_tokens=3)


def ticket(ticket_id: str) -> KVTicket:
    return KVTicket(ticket_id=ticket_id, prefill_node_id="p", prefill_address="p:1", incarnation=1,
                    transfer_endpoint=b"endpoint", block_ids=(0,), num_tokens=len(PROMPT),
                    layout_hash="L", lease_deadline=0.0, block_checksums=("c",))


def retryable(node: str, code: grpc.StatusCode = grpc.StatusCode.ABORTED) -> NodeError:
    return NodeError(node, code, "transfer failed", retryable=True)


def unreachable(node: str) -> NodeError:
    """What the gRPC client raises for a node that is not there (connection refused)."""
    return NodeError(node, grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses", retryable=True,
                     unreachable=True)


HANG = "hang"  # in a fake node's script: the call never answers (a frozen node), until cancelled


async def hang(cancelled: list[str], request_id: str) -> None:
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        cancelled.append(request_id)
        raise


@dataclass
class FakePrefill:
    name: str
    # per prefill, in order: fail, HANG, or None: answer
    failures: list[NodeError | str | None] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)  # request ids of calls cancelled by the proxy
    released: list[str] = field(default_factory=list)  # ticket ids
    aborted: list[str] = field(default_factory=list)

    async def prefill(self, request_id: str, prompt: list[int], params: SamplingParams, deadline: float,
                      metadata: Sequence[tuple[str, str]] = ()) -> Prefilled:
        self.calls.append(request_id)
        failure = self.failures.pop(0) if self.failures else None
        if failure == HANG:
            await hang(self.cancelled, request_id)
        if isinstance(failure, NodeError):
            raise failure
        return Prefilled(7, None, None, 4, ticket(f"ticket-{self.name}-{len(self.calls)}"))

    async def release(self, ticket: KVTicket, timeout: float = 2.0) -> None:
        self.released.append(ticket.ticket_id)

    async def abort(self, request_id: str, timeout: float = 2.0) -> None:
        self.aborted.append(request_id)


@dataclass
class FakeDecode:
    name: str
    # per call: fail or HANG before streaming, or None: stream
    script: list[NodeError | str | None] = field(default_factory=list)
    fail_after_first: bool = False
    hang_after_first: bool = False
    calls: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    tickets: list[str | None] = field(default_factory=list)  # ticket ids; None for colocated requests
    aborted: list[str] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    max_tokens: list[int | None] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)  # the output_token_ids of each call

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams, prefilled: Prefilled | None,
                       deadline: float, output_token_ids: Sequence[int] = (), metadata: Sequence[tuple[str, str]] = ()
                       ) -> AsyncIterator[Decoded]:
        self.calls.append(request_id)
        self.tickets.append(prefilled.ticket.ticket_id if prefilled is not None and prefilled.ticket else None)
        self.prompts.append(list(prompt))
        self.max_tokens.append(params.max_tokens)
        self.outputs.append(list(output_token_ids))
        failure = self.script.pop(0) if self.script else None
        if failure == HANG:
            await hang(self.cancelled, request_id)
        if isinstance(failure, NodeError):
            raise failure
        if prefilled is None and not output_token_ids:  # colocated: D samples the first token itself
            yield Decoded([7], [], None, None, num_cached_tokens=12)
        yield Decoded([8], [], None, None)
        if self.fail_after_first:
            raise retryable(self.name, grpc.StatusCode.UNAVAILABLE)
        if self.hang_after_first:
            await hang(self.cancelled, request_id)
        yield Decoded([9], [], FinishReason.LENGTH, None)

    async def abort(self, request_id: str, timeout: float = 2.0) -> None:
        self.aborted.append(request_id)


@dataclass
class FakeDirectory:
    prefill: dict[str, FakePrefill]
    decode: dict[str, FakeDecode]
    index: PrefixIndex = field(default_factory=PrefixIndex)
    dead: DeadNodes = field(default_factory=DeadNodes)  # the real dead-node cache, as NodeDirectory holds it
    liveness: Liveness = field(default_factory=Liveness)  # the real one too

    async def start(self) -> None:
        return None

    def nodes(self, role: Role) -> list[NodeView]:
        names = self.prefill if role is Role.PREFILL else self.decode
        return [NodeView(name, role, name, "L", NodeCapacity(100, 8, 256, 4), NodeLoad(100, 0, 0, 0))
                for name in names if not self.dead.is_down(name)]

    def mark_down(self, node: NodeView) -> None:
        self.dead.mark_down(node.address)
        self.liveness.lose(node.address, "unreachable")

    def mark_alive(self, node: NodeView) -> None:
        self.dead.mark_alive(node.address)

    def is_down(self, node: NodeView) -> bool:
        return self.dead.is_down(node.address)

    def prefill_client(self, node: NodeView) -> FakePrefill:
        return self.prefill[node.address]

    def decode_client(self, node: NodeView) -> FakeDecode:
        return self.decode[node.address]


def pipeline(directory: FakeDirectory, colocate_max_tokens: int = 0) -> PDPipeline:
    router = Router(directory, RouterConfig(block_size=4, colocate_max_tokens=colocate_max_tokens))
    return PDPipeline(directory, router, max_retries=2)  # type: ignore[arg-type]


def run(p: PDPipeline, take: int | None = None) -> list[TokenChunk]:
    async def collect() -> list[TokenChunk]:
        chunks = []
        stream = p.generate("r", PROMPT, PARAMS, deadline=1e12)
        try:
            async for chunk in stream:
                chunks.append(chunk)
                if take is not None and len(chunks) == take:
                    break
        finally:
            await stream.aclose()
        return chunks

    return asyncio.run(collect())


def tokens(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def test_a_failed_prefill_runs_again_on_another_prefill_node() -> None:
    p1, p2 = FakePrefill("p1", [retryable("p1", grpc.StatusCode.UNAVAILABLE)]), FakePrefill("p2")
    d = FakeDecode("d1")
    chunks = run(pipeline(FakeDirectory({"p1": p1, "p2": p2}, {"d1": d})))
    assert tokens(chunks) == [7, 8, 9] and len(p1.calls) == 1 and len(p2.calls) == 1
    assert d.tickets == ["ticket-p2-1"]


def test_a_non_retryable_prefill_error_is_raised_at_once() -> None:
    p1 = FakePrefill("p1", [NodeError("p1", grpc.StatusCode.INVALID_ARGUMENT, "bad prompt", retryable=False)])
    p2 = FakePrefill("p2")
    with pytest.raises(NodeError):
        run(pipeline(FakeDirectory({"p1": p1, "p2": p2}, {"d1": FakeDecode("d1")})))
    assert p2.calls == []


def test_a_failed_handoff_prefills_again_elsewhere_and_keeps_the_first_token() -> None:
    p1, p2 = FakePrefill("p1"), FakePrefill("p2")
    d = FakeDecode("d1", script=[retryable("d1"), None])
    chunks = run(pipeline(FakeDirectory({"p1": p1, "p2": p2}, {"d1": d})))
    assert tokens(chunks) == [7, 8, 9]  # the first token was sent once
    assert p1.released == ["ticket-p1-1"] and p2.calls == ["r-retry1"] and d.tickets == ["ticket-p1-1", "ticket-p2-1"]


def test_retries_are_bounded() -> None:
    p1 = FakePrefill("p1")
    d = FakeDecode("d1", script=[retryable("d1")] * 5)
    with pytest.raises(NodeError):
        run(pipeline(FakeDirectory({"p1": p1}, {"d1": d})))
    assert len(d.tickets) == 3 and len(p1.calls) == 3  # the first try and max_retries=2 more


def test_a_decode_node_lost_after_streaming_with_no_other_decode_node_is_raised_not_replayed() -> None:
    p1, p2 = FakePrefill("p1"), FakePrefill("p2")
    d = FakeDecode("d1", fail_after_first=True)  # no other D to migrate to (tests/unit/test_pd_migration.py)
    with pytest.raises(NodeError):
        run(pipeline(FakeDirectory({"p1": p1, "p2": p2}, {"d1": d})))
    assert len(d.tickets) == 1 and p2.calls == [] and d.aborted == ["r"]


def test_colocated_requests_go_to_the_decode_node_without_a_ticket() -> None:
    p1, d = FakePrefill("p1"), FakeDecode("d1")
    chunks = run(pipeline(FakeDirectory({"p1": p1}, {"d1": d}), colocate_max_tokens=1000))
    assert tokens(chunks) == [7, 8, 9] and chunks[0].num_cached_tokens == 12
    assert d.tickets == [None] and p1.calls == []


def test_an_unreachable_colocated_decode_node_is_replaced_by_another() -> None:
    d1 = FakeDecode("d1", script=[retryable("d1", grpc.StatusCode.UNAVAILABLE)])
    d2 = FakeDecode("d2")
    chunks = run(pipeline(FakeDirectory({}, {"d1": d1, "d2": d2}), colocate_max_tokens=1000))
    assert tokens(chunks) == [7, 8, 9] and d2.tickets == [None]


def test_a_client_that_goes_away_aborts_on_d_and_releases_on_p() -> None:
    p1, d = FakePrefill("p1"), FakeDecode("d1")
    chunks = run(pipeline(FakeDirectory({"p1": p1}, {"d1": d})), take=2)
    assert tokens(chunks) == [7, 8] and d.aborted == ["r"] and p1.released == ["ticket-p1-1"]


# ---- unreachable nodes ----
def test_an_unreachable_prefill_node_is_left_out_of_routing_at_once() -> None:
    p1, p2 = FakePrefill("p1", [unreachable("p1")]), FakePrefill("p2")
    directory = FakeDirectory({"p1": p1, "p2": p2}, {"d1": FakeDecode("d1")})
    p = pipeline(directory)
    assert tokens(run(p)) == [7, 8, 9] and len(p1.calls) == 1 and len(p2.calls) == 1
    for _ in range(3):  # the next requests go straight to p2, not to p1 first
        assert tokens(run(p)) == [7, 8, 9]
    assert len(p1.calls) == 1 and len(p2.calls) == 4 and directory.dead.is_down("p1")


def test_with_no_prefill_node_left_the_decode_node_prefills_the_request() -> None:
    p1 = FakePrefill("p1", [unreachable("p1")])
    d = FakeDecode("d1")
    directory = FakeDirectory({"p1": p1}, {"d1": d})
    p = pipeline(directory)
    chunks = run(p)
    assert tokens(chunks) == [7, 8, 9] and chunks[0].num_cached_tokens == 12  # D's own first token and prefix hit
    assert d.tickets == [None] and d.prompts == [PROMPT]
    assert tokens(run(p)) == [7, 8, 9]  # routed colocated at once: p1 is not tried again
    assert len(p1.calls) == 1 and d.tickets == [None, None] and p.router.decision_counts["colocated"] == 1


def test_a_handoff_whose_prefill_node_died_continues_on_the_decode_node_from_the_first_token() -> None:
    # D's pull fails (P died after its first token), and P cannot be reached to prefill again
    p1 = FakePrefill("p1", [None, unreachable("p1")])  # the first prefill answers; the second finds P gone
    d = FakeDecode("d1", script=[retryable("d1"), None])
    chunks = run(pipeline(FakeDirectory({"p1": p1}, {"d1": d})))
    # the first token came from P once; D continues the request after that token (its output so far)
    assert tokens(chunks) == [7, 8, 9] and d.prompts[1] == PROMPT and d.outputs == [[], [7]]
    assert d.max_tokens == [3, 3]  # the engine counts the output tokens: the parameters stay the request's
    assert d.tickets == ["ticket-p1-1", None] and p1.released == ["ticket-p1-1"]
    assert all(c.num_cached_tokens is None for c in chunks[1:])


def test_the_dead_node_cache_backs_off_longer_while_a_node_stays_dead_and_forgets_it_when_alive() -> None:
    now = [0.0]
    dead = DeadNodes(base_s=1.0, max_s=4.0, clock=lambda: now[0])
    assert dead.mark_down("p") == 1.0 and dead.is_down("p")
    now[0] = 0.5
    assert dead.mark_down("p") == 0.5  # a request in flight at the same time: no longer
    now[0] = 1.0
    assert not dead.is_down("p")  # offered again: one request tries it
    assert dead.mark_down("p") == 2.0 and dead.is_down("p")
    now[0] = 3.0
    assert dead.mark_down("p") == 4.0
    now[0] = 7.0
    assert dead.mark_down("p") == 4.0  # capped
    dead.mark_alive("p")
    assert not dead.is_down("p") and dead.mark_down("p") == 1.0  # alive in between: a short back-off again
