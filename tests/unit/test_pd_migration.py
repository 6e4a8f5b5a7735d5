"""Decode migration (issue 13, item 2) with scripted nodes: a decode node lost after it streamed tokens (unreachable,
as after kill -9, or given up, as a frozen one) hands the request to another, which continues it from the prompt and
the tokens already sent; the client's stream has every token once. The fake decode nodes generate from one oracle
sequence (output token i is ORACLE[i] wherever it is sampled), as a greedy model would."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from engine.types import FinishReason, Logprob, SamplingParams
from proxy.api.app import create_app
from proxy.api.serving import ProxyState, fan_out, generate
from proxy.routing.attempts import AttemptAbandoned
from proxy.routing.clients import Decoded, NodeError, Prefilled
from proxy.routing.liveness import FAILED_CHECKS_TO_LOSE
from proxy.routing.pd import PDPipeline, TokenChunk
from proxy.routing.router import Router, RouterConfig
from tests.unit.test_pd_pipeline import PROMPT, FakeDirectory, FakePrefill, hang

ORACLE = list(range(7, 7 + 64))  # FakePrefill's first token is 7: output token 0
MAX_TOKENS = 8
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, logprobs=0)
HANG = "hang"


def unreachable(name: str) -> NodeError:
    """What the gRPC client raises when a decode node is gone (connection refused or reset, as after kill -9)."""
    return NodeError(f"decode {name}", grpc.StatusCode.UNAVAILABLE, "Socket closed", retryable=True,
                     unreachable=True)


def logprob_of(token_id: int) -> dict[int, Logprob]:
    """Each token's logprob names it, so the test can tell that they continue with their tokens."""
    return {token_id: Logprob(-token_id / 100, 1)}


@dataclass
class OracleDecode:
    """A decode node generating `oracle`: it continues after the prompt's first token (a handoff) or after the
    output tokens it is given (a continuation), up to max_tokens in all. After streaming `fail_after` tokens of a
    call it dies (the stream breaks: unreachable), fails with `own_error`, or freezes (`freeze`)."""

    name: str
    fail_after: int | None = None
    oracle: list[int] = field(default_factory=lambda: ORACLE)
    own_error: NodeError | None = None
    freeze: bool = False
    delay_s: float = 0.0  # before it fails
    before_streaming: list[NodeError] = field(default_factory=list)  # failures of the next calls, before a token
    calls: list[str] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)  # the output_token_ids of each call
    max_tokens: list[int | None] = field(default_factory=list)
    tickets: list[str | None] = field(default_factory=list)
    streamed: list[int] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams, prefilled: Prefilled | None,
                       deadline: float, output_token_ids: Sequence[int] = (), metadata: Sequence[tuple[str, str]] = ()
                       ) -> AsyncIterator[Decoded]:
        self.calls.append(request_id)
        self.prompts.append(list(prompt))
        self.outputs.append(list(output_token_ids))
        self.max_tokens.append(params.max_tokens)
        self.tickets.append(prefilled.ticket.ticket_id if prefilled is not None and prefilled.ticket else None)
        if self.before_streaming:
            raise self.before_streaming.pop(0)
        assert params.max_tokens is not None
        start = 1 if prefilled is not None else len(output_token_ids)
        for count, index in enumerate(range(start, params.max_tokens)):
            if count == self.fail_after:
                await asyncio.sleep(self.delay_s)
                if self.freeze:
                    await hang(self.cancelled, request_id)
                raise self.own_error or unreachable(self.name)
            await asyncio.sleep(0)
            token_id = self.oracle[index]
            self.streamed.append(token_id)
            last = index == params.max_tokens - 1
            cached = 12 if prefilled is None and count == 0 else None  # a colocated request's prefix hit on D
            yield Decoded([token_id], [logprob_of(token_id)], FinishReason.LENGTH if last else None, None, cached)

    async def abort(self, request_id: str, timeout: float = 2.0) -> None:
        self.aborted.append(request_id)


def pipeline(directory: FakeDirectory, colocated: bool = False, max_retries: int = 2) -> PDPipeline:
    router = Router(directory, RouterConfig(block_size=4, colocate_max_tokens=1000 if colocated else 0))
    return PDPipeline(directory, router, max_retries=max_retries)  # type: ignore[arg-type]


def run(p: PDPipeline, directory: FakeDirectory | None = None, freeze: OracleDecode | None = None,
        deadline: float = 1e12) -> tuple[list[TokenChunk], Exception | None]:
    """The chunks the client got and the error that ended the stream, if any. With `freeze`, that node fails its
    health checks once it has streamed (as the directory's health loop would report a frozen node)."""
    chunks: list[TokenChunk] = []

    async def collect() -> Exception | None:
        try:
            async for chunk in p.generate("r", PROMPT, PARAMS, deadline):
                chunks.append(chunk)
        except NodeError as e:
            return e
        return None

    async def main() -> Exception | None:
        request = asyncio.ensure_future(collect())
        if freeze is not None and directory is not None:
            while len(freeze.streamed) < (freeze.fail_after or 0):
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.01)  # the node hangs, the attempt waits on it
            for _ in range(FAILED_CHECKS_TO_LOSE):
                directory.liveness.check_failed(freeze.name, "Health not answered (DEADLINE_EXCEEDED)")
        error = await asyncio.wait_for(request, 5)
        await asyncio.sleep(0.01)  # the background aborts to nodes given up on go out
        return error

    return chunks, asyncio.run(main())


def tokens(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def check_one_stream(chunks: list[TokenChunk]) -> None:
    """Every token of the undisturbed request once, in order, each with its own logprobs; the prefix hit
    reported once (usage's cached tokens); the last chunk finishes it."""
    assert tokens(chunks) == ORACLE[:MAX_TOKENS]
    assert all(c.logprobs == [logprob_of(t) for t in c.token_ids] for c in chunks[1:])  # the first may be P's
    assert [c.num_cached_tokens for c in chunks if c.num_cached_tokens is not None] == [chunks[0].num_cached_tokens]
    assert chunks[-1].finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("k", [1, 3, MAX_TOKENS - 2])
def test_a_decode_node_lost_after_k_tokens_hands_the_request_to_another_that_continues_after_them(k: int) -> None:
    p1 = FakePrefill("p1")
    d1, d2 = OracleDecode("d1", fail_after=k), OracleDecode("d2")
    directory = FakeDirectory({"p1": p1}, {"d1": d1, "d2": d2})
    p = pipeline(directory)
    chunks, error = run(p)
    assert error is None
    check_one_stream(chunks)
    sent = ORACLE[:1 + k]  # P's first token and d1's k
    assert d1.streamed == sent[1:]
    # d2: the original prompt, the tokens sent as output, the request's own max_tokens (the engine counts the
    # output tokens, so it generates max_tokens - (1 + k) more: what it streamed)
    assert d2.prompts == [PROMPT] and d2.outputs == [sent] and d2.max_tokens == [MAX_TOKENS]
    assert d2.streamed == ORACLE[1 + k:MAX_TOKENS] and d2.tickets == [None] and d2.calls == ["r-retry1"]
    assert p1.calls == ["r"]  # no prefill again: d2 computes prompt + output itself
    assert d1.aborted == ["r"] and directory.dead.is_down("d1")
    assert p.migrations.counts == {"migrated": 1} and p.attempts.counts.retries == {"decode": 1}


def test_a_colocated_request_migrates_too_and_reports_its_prefix_hit_once() -> None:
    d1, d2 = OracleDecode("d1", fail_after=3), OracleDecode("d2")
    p = pipeline(FakeDirectory({}, {"d1": d1, "d2": d2}), colocated=True)
    chunks, error = run(p)
    assert error is None
    check_one_stream(chunks)
    assert chunks[0].num_cached_tokens == 12 and d2.outputs == [ORACLE[:3]] and d2.tickets == [None]
    assert p.migrations.counts == {"migrated": 1}


def test_a_decode_node_frozen_after_streaming_is_given_up_and_the_request_migrates() -> None:
    p1 = FakePrefill("p1")
    d1, d2 = OracleDecode("d1", fail_after=2, freeze=True), OracleDecode("d2")
    directory = FakeDirectory({"p1": p1}, {"d1": d1, "d2": d2})
    p = pipeline(directory)
    chunks, error = run(p, directory, freeze=d1)
    assert error is None
    check_one_stream(chunks)
    assert d1.cancelled == ["r"] and d1.aborted == ["r"] and d2.outputs == [ORACLE[:3]]
    assert p.attempts.counts.abandoned == {("decode", "node_lost"): 1} and p.migrations.counts == {"migrated": 1}


def test_a_request_migrates_again_when_its_second_decode_node_is_lost_too() -> None:
    d1, d2, d3 = OracleDecode("d1", fail_after=2), OracleDecode("d2", fail_after=2), OracleDecode("d3")
    p = pipeline(FakeDirectory({"p1": FakePrefill("p1")}, {"d1": d1, "d2": d2, "d3": d3}))
    chunks, error = run(p)
    assert error is None
    check_one_stream(chunks)
    assert d2.outputs == [ORACLE[:3]] and d3.outputs == [ORACLE[:5]] and d3.calls == ["r-retry2"]
    assert p.migrations.counts == {"migrated": 2}


def test_migrations_take_the_requests_retries_and_end_with_the_error_when_none_is_left() -> None:
    nodes = {f"d{i}": OracleDecode(f"d{i}", fail_after=1) for i in range(1, 5)}
    p = pipeline(FakeDirectory({"p1": FakePrefill("p1")}, nodes), max_retries=2)
    chunks, error = run(p)
    assert isinstance(error, NodeError) and error.unreachable
    assert tokens(chunks) == ORACLE[:4]  # P's token and one from each of three nodes: sent once each
    assert p.migrations.counts == {"migrated": 2, "no_retry_left": 1}
    assert sum(len(n.calls) for n in nodes.values()) == 3


def test_a_retry_spent_before_the_first_token_leaves_one_fewer_for_migration() -> None:
    # d1 is unreachable before it streams (the existing path: a fresh ticket for d2), then d2 dies mid-stream
    d1 = OracleDecode("d1", before_streaming=[unreachable("d1")])
    d2, d3 = OracleDecode("d2", fail_after=2), OracleDecode("d3")
    p = pipeline(FakeDirectory({"p1": FakePrefill("p1")}, {"d1": d1, "d2": d2, "d3": d3}), max_retries=1)
    chunks, error = run(p)
    assert isinstance(error, NodeError) and tokens(chunks) == ORACLE[:3]
    assert p.migrations.counts == {"no_retry_left": 1} and d3.calls == []


def test_with_no_other_decode_node_the_stream_ends_with_the_error() -> None:
    d1 = OracleDecode("d1", fail_after=3)
    p = pipeline(FakeDirectory({"p1": FakePrefill("p1")}, {"d1": d1}))
    chunks, error = run(p)
    assert isinstance(error, NodeError) and error.unreachable and error.role == "decode"
    assert tokens(chunks) == ORACLE[:4] and d1.calls == ["r"] and d1.aborted == ["r"]
    assert p.migrations.counts == {"no_decode_node": 1}


def test_a_frozen_decode_node_with_no_other_ends_the_stream_with_the_abandonment() -> None:
    d1 = OracleDecode("d1", fail_after=2, freeze=True)
    directory = FakeDirectory({"p1": FakePrefill("p1")}, {"d1": d1})
    p = pipeline(directory)
    _, error = run(p, directory, freeze=d1)
    assert isinstance(error, AttemptAbandoned) and p.migrations.counts == {"no_decode_node": 1}


def test_no_migration_starts_past_the_requests_deadline() -> None:
    d1, d2 = OracleDecode("d1", fail_after=2, delay_s=0.3), OracleDecode("d2")
    p = pipeline(FakeDirectory({"p1": FakePrefill("p1")}, {"d1": d1, "d2": d2}))
    chunks, error = run(p, deadline=time.time() + 0.2)
    assert isinstance(error, NodeError) and tokens(chunks) == ORACLE[:3] and d2.calls == []
    assert p.migrations.counts == {"past_deadline": 1}


def test_a_decode_nodes_own_error_after_streaming_is_not_migrated() -> None:
    internal = NodeError("decode d1", grpc.StatusCode.INTERNAL, "engine failed", retryable=False)
    d1, d2 = OracleDecode("d1", fail_after=2, own_error=internal), OracleDecode("d2")
    p = pipeline(FakeDirectory({"p1": FakePrefill("p1")}, {"d1": d1, "d2": d2}))
    _, error = run(p)
    assert error is internal and d2.calls == [] and p.migrations.counts == {}


@pytest.mark.parametrize("colocated", [False, True])
def test_a_failure_before_any_token_from_d_takes_the_existing_retry_path(colocated: bool) -> None:
    p1 = FakePrefill("p1")
    d1, d2 = OracleDecode("d1", before_streaming=[unreachable("d1")]), OracleDecode("d2")
    p = pipeline(FakeDirectory({"p1": p1}, {"d1": d1, "d2": d2}), colocated=colocated)
    chunks, error = run(p)
    assert error is None and tokens(chunks) == ORACLE[:MAX_TOKENS]
    assert d2.outputs == [[]] and p.migrations.counts == {}
    # disaggregated: prefilled again for a fresh ticket; colocated: d2 prefills the prompt itself
    assert d2.tickets == [None if colocated else "ticket-p1-2"]


# ---- what the client sees, through the proxy's serving layer (text, stop strings, usage, metrics) ----
def _serve(tokenizer_dir: Path, letters: str, params: SamplingParams) -> tuple[ProxyState, str, str | None, int,
                                                                               list[int | None], str]:
    """Serves a colocated request whose node dies after 2 tokens: (state, text, finish, tokens, prefix hits
    reported, /metrics)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    oracle = tokenizer.convert_tokens_to_ids(list(letters))
    d1, d2 = OracleDecode("d1", fail_after=2, oracle=oracle), OracleDecode("d2", oracle=oracle)
    state = ProxyState(pipeline(FakeDirectory({}, {"d1": d1, "d2": d2}), colocated=True), tokenizer, "m")
    create_app(state)  # wires /metrics to the pipeline's counts

    async def main() -> list[tuple[str, str | None, int, int | None]]:
        return [(d.text, d.finish_reason, d.num_tokens, d.num_cached_tokens)
                async for d in generate(state, "r", fan_out([PROMPT], params), 0.0)]

    deltas = asyncio.run(main())
    return (state, "".join(d[0] for d in deltas), deltas[-1][1], sum(d[2] for d in deltas),
            [d[3] for d in deltas if d[3] is not None], state.metrics.render().decode())


def test_the_client_gets_one_text_and_usage_counts_each_token_once(tokenizer_dir: Path) -> None:
    _, text, finish, num_tokens, cached, metrics = _serve(tokenizer_dir, "ABCDEFGH", SamplingParams(max_tokens=8))
    assert text == "ABCDEFGH" and finish == "length" and num_tokens == 8 and cached == [12]
    assert 'tandem:decode_migrations_total{model_name="m",outcome="migrated"} 1.0' in metrics
    assert 'tandem:decode_migrations_total{model_name="m",outcome="no_decode_node"} 0.0' in metrics


def test_a_stop_string_spanning_both_decode_nodes_is_found(tokenizer_dir: Path) -> None:
    # "B" is the last token of the node that died, "C" the first of the one that continued
    _, text, finish, num_tokens, _, _ = _serve(tokenizer_dir, "ABCDEFGH", SamplingParams(max_tokens=8, stop="BC"))
    assert text == "A" and finish == "stop" and num_tokens == 3
