"""Attempts in flight on a node the proxy gives up on (issue 13, defect 3), with scripted nodes that never answer:
the attempt is cancelled and retried where that is safe, its node gets an abort, and the progress timeouts abandon
an attempt whose node still passes its health checks."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable

import pytest

from proxy.routing.attempts import AbandonReason, AttemptAbandoned, AttemptLimits
from proxy.routing.clients import NodeError
from proxy.routing.directory import NodeDirectory, NodeView
from proxy.routing.liveness import FAILED_CHECKS_TO_LOSE, Liveness
from proxy.routing.pd import PDPipeline, TokenChunk
from proxy.routing.router import Router, RouterConfig
from tests.unit.test_pd_pipeline import HANG, PARAMS, PROMPT, FakeDecode, FakeDirectory, FakePrefill, tokens
from wire import Role


def pipeline(directory: FakeDirectory, limits: AttemptLimits | None = None) -> PDPipeline:
    router = Router(directory, RouterConfig(block_size=4, colocate_max_tokens=0))
    return PDPipeline(directory, router, max_retries=2, limits=limits)  # type: ignore[arg-type]


def run(p: PDPipeline, directory: FakeDirectory, lose: str | None = None,
        when: Callable[[], bool] = lambda: True) -> list[TokenChunk]:
    """The request's chunks; once `when()` holds, node `lose` fails its health checks, as the directory's health
    loop would report a frozen node."""
    async def collect() -> list[TokenChunk]:
        chunks: list[TokenChunk] = []
        async for chunk in p.generate("r", PROMPT, PARAMS, deadline=1e12):
            chunks.append(chunk)
        return chunks

    async def main() -> list[TokenChunk]:
        request = asyncio.ensure_future(collect())
        if lose is not None:
            while not when():
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.01)  # the attempt waits on the node
            for _ in range(FAILED_CHECKS_TO_LOSE):
                directory.liveness.check_failed(lose, "Health not answered (DEADLINE_EXCEEDED)")
        chunks = await asyncio.wait_for(request, 5)
        await asyncio.sleep(0.01)  # the background aborts to nodes given up on go out
        return chunks

    return asyncio.run(main())


def test_a_prefill_attempt_on_a_lost_node_is_cancelled_and_runs_on_another_prefill_node() -> None:
    p1, p2, d = FakePrefill("p1", [HANG]), FakePrefill("p2"), FakeDecode("d1")
    directory = FakeDirectory({"p1": p1, "p2": p2}, {"d1": d})
    p = pipeline(directory)
    assert tokens(run(p, directory, lose="p1", when=lambda: bool(p1.calls))) == [7, 8, 9]
    assert p1.cancelled == ["r"] and p2.calls == ["r-retry1"] and d.tickets == ["ticket-p2-1"]
    # the lost node is out of routing and gets an abort of the attempt's own id (for when it thaws)
    assert directory.dead.is_down("p1") and p1.aborted == ["r"]
    assert p.attempts.counts.abandoned == {("prefill", "node_lost"): 1}
    assert p.attempts.counts.retries == {"prefill": 1}


def test_with_the_only_prefill_node_lost_the_decode_node_prefills_the_request() -> None:
    p1, d = FakePrefill("p1", [HANG]), FakeDecode("d1")
    directory = FakeDirectory({"p1": p1}, {"d1": d})
    chunks = run(pipeline(directory), directory, lose="p1", when=lambda: bool(p1.calls))
    assert tokens(chunks) == [7, 8, 9] and chunks[0].num_cached_tokens == 12  # D's own first token
    assert p1.cancelled == ["r"] and d.tickets == [None] and d.prompts == [PROMPT]


def test_a_decode_node_lost_before_its_first_token_hands_the_request_to_another_with_a_fresh_ticket() -> None:
    p1 = FakePrefill("p1")
    d1, d2 = FakeDecode("d1", script=[HANG]), FakeDecode("d2")
    directory = FakeDirectory({"p1": p1}, {"d1": d1, "d2": d2})
    p = pipeline(directory)
    chunks = run(p, directory, lose="d1", when=lambda: bool(d1.calls))
    assert tokens(chunks) == [7, 8, 9]  # the first token (from P) was sent once
    assert d1.cancelled == ["r"] and d1.aborted == ["r"] and directory.dead.is_down("d1")
    assert p1.released == ["ticket-p1-1"] and d2.calls == ["r-retry1"] and d2.tickets == ["ticket-p1-2"]
    assert p.attempts.counts.abandoned == {("decode", "node_lost"): 1}


def test_losing_the_prefill_node_a_decode_node_pulls_from_prefills_again_elsewhere_for_the_same_decode_node(
        ) -> None:
    p1, p2 = FakePrefill("p1"), FakePrefill("p2")
    d = FakeDecode("d1", script=[HANG, None])  # the first Generate waits for a pull from p1 that never ends
    directory = FakeDirectory({"p1": p1, "p2": p2}, {"d1": d})
    chunks = run(pipeline(directory), directory, lose="p1", when=lambda: bool(d.calls))
    assert tokens(chunks) == [7, 8, 9]
    assert d.cancelled == ["r"] and d.aborted == ["r"]
    assert d.calls == ["r", "r-retry1"] and d.tickets == ["ticket-p1-1", "ticket-p2-1"]
    assert directory.dead.is_down("p1") and not directory.dead.is_down("d1")
    assert p1.released == ["ticket-p1-1"]  # sent to the lost node in the background, for when it thaws


def test_a_decode_node_lost_after_it_streamed_with_no_other_decode_node_ends_the_request_with_an_error() -> None:
    # with another decode node the request migrates there: tests/unit/test_pd_migration.py
    p1, p2 = FakePrefill("p1"), FakePrefill("p2")
    d1 = FakeDecode("d1", hang_after_first=True)
    directory = FakeDirectory({"p1": p1, "p2": p2}, {"d1": d1})
    with pytest.raises(AttemptAbandoned) as raised:
        run(pipeline(directory), directory, lose="d1", when=lambda: bool(d1.calls))
    assert raised.value.reason is AbandonReason.NODE_LOST and raised.value.role == "decode"
    assert d1.cancelled == ["r"] and p2.calls == []  # no replay of the tokens sent
    assert d1.aborted == ["r"] and p1.released == ["ticket-p1-1"]


def test_a_prefill_without_an_answer_within_its_timeout_runs_elsewhere_and_its_node_stays_in_routing() -> None:
    p1, p2, d = FakePrefill("p1", [HANG]), FakePrefill("p2"), FakeDecode("d1")
    directory = FakeDirectory({"p1": p1, "p2": p2}, {"d1": d})
    p = pipeline(directory, AttemptLimits(prefill_timeout_s=0.05))
    assert tokens(run(p, directory)) == [7, 8, 9]
    assert p1.cancelled == ["r"] and p1.aborted == ["r"] and p2.calls == ["r-retry1"]
    assert not directory.dead.is_down("p1")  # it answers its health checks: only this attempt was slow
    assert p.attempts.counts.abandoned == {("prefill", "timeout"): 1}


def test_a_decode_node_without_a_first_token_within_its_timeout_is_left_for_another() -> None:
    p1 = FakePrefill("p1")
    d1, d2 = FakeDecode("d1", script=[HANG]), FakeDecode("d2")
    directory = FakeDirectory({"p1": p1}, {"d1": d1, "d2": d2})
    p = pipeline(directory, AttemptLimits(first_token_timeout_s=0.05))
    assert tokens(run(p, directory)) == [7, 8, 9]
    assert d1.cancelled == ["r"] and d2.calls == ["r-retry1"]
    assert p.attempts.counts.abandoned == {("decode", "timeout"): 1}


def test_the_first_token_timeout_does_not_cut_a_stream_that_has_started() -> None:
    async def slow_tokens() -> AsyncIterator[object]:
        yield object()
        await asyncio.sleep(0.2)  # four times the first-token timeout between tokens
        yield object()

    liveness = Liveness()
    attempts = pipeline(FakeDirectory({}, {}, liveness=liveness), AttemptLimits(first_token_timeout_s=0.05)).attempts
    node = NodeView("d1", Role.DECODE, "d1")

    async def main() -> int:
        return len([item async for item in attempts.stream(node, slow_tokens(), 0.05)])

    assert asyncio.run(main()) == 2


def test_a_node_is_lost_after_consecutive_failed_checks_only_and_a_passed_check_starts_the_count_again() -> None:
    liveness = Liveness(failed_checks_to_lose=2)
    with liveness.watch("n") as watch:
        assert not liveness.check_failed("n", "x") and not watch.lost
        liveness.check_passed("n")
        assert not liveness.check_failed("n", "x") and not watch.lost
        assert liveness.check_failed("n", "no answer") and watch.lost_because is not None
        assert "no answer" in watch.lost_because
        assert liveness.to_check() == ["n"]
        with liveness.watch("n") as later:  # sent to a node already failing: told at the next failed check
            assert liveness.check_failed("n", "x") and later.lost
    assert liveness.to_check() == []
    with liveness.watch("n") as again:  # not polled: checked only while watched, its count starts again
        assert not liveness.check_failed("n", "x") and not again.lost


def test_a_polled_node_keeps_its_count_between_attempts() -> None:
    liveness = Liveness(polled=["n"], failed_checks_to_lose=2)
    assert not liveness.check_failed("n", "x")
    with liveness.watch("n"):
        assert liveness.to_check() == []  # the directory polls it anyway
    with liveness.watch("n") as watch:
        assert liveness.check_failed("n", "x") and watch.lost


def test_an_abandoned_attempt_is_a_retryable_failure_worth_another_node() -> None:
    error = AttemptAbandoned(NodeView("p1", Role.PREFILL, "p1"), AbandonReason.TIMEOUT, "slow")
    assert isinstance(error, NodeError) and error.retryable and error.try_another_node and not error.unreachable


def test_the_directory_gives_up_silent_nodes_with_attempts_in_flight_after_two_failed_health_checks() -> None:
    """A frozen node's kernel still accepts connections; nothing answers on them. Both a listed (polled) node and
    an unlisted one (as a registered node is: checked only while attempts are in flight) are given up."""
    with contextlib.ExitStack() as stack:
        addresses = []
        for _ in range(2):
            silent = stack.enter_context(socket.socket())
            silent.bind(("127.0.0.1", 0))
            silent.listen()
            addresses.append(f"127.0.0.1:{silent.getsockname()[1]}")
        listed, unlisted = addresses

        async def main() -> None:
            directory = NodeDirectory(static_prefill=[listed], health_timeout_s=0.2)
            directory.client(NodeView(unlisted, Role.DECODE, "d"))  # an attempt's client
            try:
                with directory.liveness.watch(listed) as on_listed, directory.liveness.watch(unlisted) as on_unlisted:
                    await directory.check_health()
                    assert not on_listed.lost and not on_unlisted.lost  # one failed check is not enough
                    await directory.check_health()
                    assert on_listed.lost and on_unlisted.lost
                    assert "Health not answered" in (on_unlisted.lost_because or "")
            finally:
                await directory.close()

        asyncio.run(main())
