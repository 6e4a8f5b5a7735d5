"""The scheduler's budget, seats, chunking and preemption, without a model."""

from __future__ import annotations

from engine.cache.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from engine.types import SamplingParams


def make(num_blocks: int = 16, budget: int = 8, seats: int = 4) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, 4, True, "s"), budget, seats)


def request(n: int, request_id: str) -> Request:
    return Request(request_id, list(range(100, 100 + n)), SamplingParams())


def run_step(s: Scheduler) -> list[tuple[str, int]]:
    out = s.schedule()
    s.advance(out)
    for item in out.scheduled:
        if item.request.num_computed_tokens == item.request.num_tokens:
            item.request.token_ids.append(1)  # what sampling would do
    return [(i.request.request_id, i.num_new_tokens) for i in out.scheduled]


def test_long_prompts_are_chunked_within_the_token_budget() -> None:
    s = make(budget=8)
    s.add(request(13, "a"))
    s.add(request(3, "b"))
    assert run_step(s) == [("a", 8)]
    assert run_step(s) == [("a", 5), ("b", 3)]
    assert run_step(s) == [("a", 1), ("b", 1)]  # both decoding now


def test_seats_limit_running_requests() -> None:
    s = make(seats=2, budget=100)
    for name in "abc":
        s.add(request(2, name))
    assert [name for name, _ in run_step(s)] == ["a", "b"]
    assert s.waiting[0].request_id == "c"


def test_preemption_frees_the_newest_and_requeues_it_first() -> None:
    s = make(num_blocks=4, budget=100)
    s.add(request(8, "old"))  # 2 blocks
    s.add(request(8, "new"))  # 2 blocks: pool full
    run_step(s)
    out = s.schedule()  # both need a third block; only preempting "new" lets "old" continue
    assert [r.request_id for r in out.preempted] == ["new"]
    assert [(i.request.request_id, i.num_new_tokens) for i in out.scheduled] == [("old", 1)]
    new = s.waiting[0]
    assert new.request_id == "new" and new.status == RequestStatus.PREEMPTED
    assert new.num_computed_tokens == 0 and new.block_ids == []


def test_finish_returns_blocks() -> None:
    s = make()
    s.add(request(5, "a"))
    run_step(s)
    (a,) = s.running
    s.finish(a)
    assert s.kv.num_free_blocks == 16 and not s.has_unfinished()


def test_a_lookup_retried_while_the_pool_is_full_counts_once() -> None:
    s = make(num_blocks=3, budget=100)
    s.add(request(8, "a"))  # 2 blocks, a third once it grows past 8 tokens
    s.add(request(8, "b"))  # needs 2 blocks: waits
    for _ in range(3):
        assert [name for name, _ in run_step(s)] == ["a"]  # "b" is looked up again each step, never admitted
    assert s.kv.num_queried_tokens == 8
