"""Prompt logprobs through the pipeline with scripted nodes: they reach the client once, on the first chunk, from
the node that prefilled the prompt, whatever route the request took (P/D, colocated, retried, migrated), and no
later call asks a node for them again."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from engine.types import Logprob, PromptLogprobs, SamplingParams
from proxy.routing.clients import Decoded, Prefilled
from proxy.routing.pd import TokenChunk
from tests.unit.test_pd_pipeline import PROMPT, FakeDecode, FakeDirectory, FakePrefill, pipeline, retryable, tokens
from tests.unit.test_pd_pipeline import unreachable as unreachable_prefill

PARAMS = SamplingParams(max_tokens=3, prompt_logprobs=1)


def prompt_logprobs_of(node: str) -> PromptLogprobs:
    """A prompt's logprobs that name the node that computed them."""
    return [None, *({token_id: Logprob(-1.0, 1), 0: Logprob(-2.0, 2, node)} for token_id in PROMPT[1:])]


@dataclass
class Prefill(FakePrefill):
    asked: list[int | None] = field(default_factory=list)  # params.prompt_logprobs of each call

    async def prefill(self, request_id: str, prompt: list[int], params: SamplingParams, deadline: float,
                      metadata: Sequence[tuple[str, str]] = ()) -> Prefilled:
        self.asked.append(params.prompt_logprobs)
        prefilled = await super().prefill(request_id, prompt, params, deadline)
        if params.prompt_logprobs is None:
            return prefilled
        return dataclasses.replace(prefilled, prompt_logprobs=prompt_logprobs_of(self.name))


@dataclass
class Decode(FakeDecode):
    asked: list[int | None] = field(default_factory=list)

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams, prefilled: Prefilled | None,
                       deadline: float, output_token_ids: Sequence[int] = (), metadata: Sequence[tuple[str, str]] = ()
                       ) -> AsyncIterator[Decoded]:
        self.asked.append(params.prompt_logprobs)
        first = True
        async for out in super().generate(request_id, prompt, params, prefilled, deadline, output_token_ids):
            # what a real D does: a request it prefills itself gets them on its first output
            if first and prefilled is None and params.prompt_logprobs is not None:
                out = dataclasses.replace(out, prompt_logprobs=prompt_logprobs_of(self.name))
            first = False
            yield out


def run(directory: FakeDirectory, colocate_max_tokens: int = 0) -> list[TokenChunk]:
    async def collect() -> list[TokenChunk]:
        return [chunk async for chunk in pipeline(directory, colocate_max_tokens).generate(
            "r", PROMPT, PARAMS, deadline=1e12)]

    return asyncio.run(collect())


def assert_once_from(chunks: list[TokenChunk], node: str) -> None:
    assert tokens(chunks) == [7, 8, 9]
    assert chunks[0].prompt_logprobs == prompt_logprobs_of(node)
    assert all(chunk.prompt_logprobs is None for chunk in chunks[1:])


def test_a_disaggregated_request_gets_the_prefill_nodes_on_its_first_chunk() -> None:
    p, d = Prefill("p1"), Decode("d1")
    assert_once_from(run(FakeDirectory({"p1": p}, {"d1": d})), "p1")
    assert p.asked == [1] and d.asked == [None]  # D continues after the prompt: it is not asked for them


def test_a_colocated_request_gets_the_decode_nodes_on_its_first_chunk() -> None:
    p, d = Prefill("p1"), Decode("d1")
    assert_once_from(run(FakeDirectory({"p1": p}, {"d1": d}), colocate_max_tokens=1000), "d1")
    assert p.asked == [] and d.asked == [1]


def test_a_handoff_prefilled_again_asks_for_none_the_second_time() -> None:
    p1, p2 = Prefill("p1"), Prefill("p2")
    d = Decode("d1", script=[retryable("d1"), None])
    assert_once_from(run(FakeDirectory({"p1": p1, "p2": p2}, {"d1": d})), "p1")
    assert p1.asked == [1] and p2.asked == [None] and d.asked == [None, None]


def test_a_colocated_request_retried_on_another_decode_node_gets_that_nodes() -> None:
    d1 = Decode("d1", script=[retryable("d1", grpc.StatusCode.UNAVAILABLE)])
    d2 = Decode("d2")
    assert_once_from(run(FakeDirectory({}, {"d1": d1, "d2": d2}), colocate_max_tokens=1000), "d2")
    assert d1.asked == [1] and d2.asked == [1]


def test_a_continuation_from_the_first_token_asks_the_decode_node_for_none() -> None:
    # D's pull fails and P cannot be reached again: D goes on alone after the first token P sent
    p = Prefill("p1", [None, unreachable_prefill("p1")])
    d = Decode("d1", script=[retryable("d1"), None])
    assert_once_from(run(FakeDirectory({"p1": p}, {"d1": d})), "p1")
    assert d.outputs == [[], [7]] and d.asked == [None, None]


def test_a_migrated_request_repeats_none() -> None:
    p = Prefill("p1")
    d1, d2 = Decode("d1", fail_after_first=True), Decode("d2")
    chunks = run(FakeDirectory({"p1": p}, {"d1": d1, "d2": d2}))
    assert chunks[0].prompt_logprobs == prompt_logprobs_of("p1")
    assert all(chunk.prompt_logprobs is None for chunk in chunks[1:])
    assert d2.outputs == [[7, 8]] and d2.asked == [None]
