"""The scheduler's budget, seats, chunking and preemption, without a model."""

from __future__ import annotations

from engine.cache.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampler import SampledToken
from engine.scheduler import Scheduler
from engine.types import FinishReason, SamplingParams


def make(num_blocks: int = 16, budget: int = 8, seats: int = 4) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, 4, True, "s"), budget, seats)


def request(n: int, request_id: str) -> Request:
    return Request(request_id, list(range(100, 100 + n)), SamplingParams(max_tokens=None), max_num_tokens=1000)


def run_step(s: Scheduler) -> list[tuple[str, int]]:
    out = s.schedule()
    # what the runner would do: a token for every request whose step reaches its last token
    s.update_from_output(out, {i.request.request_id: [SampledToken(1)] for i in out.scheduled if i.samples})
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


def test_abort_returns_blocks_and_forgets_the_request() -> None:
    s = make()
    s.add(request(5, "a"))
    run_step(s)
    (a,) = s.running
    assert s.abort("a") and not s.abort("a")
    assert a.status is RequestStatus.FINISHED_ABORTED and a.finish_reason is FinishReason.ABORT
    assert s.kv.num_free_blocks == 16 and not s.has_unfinished() and not s.requests


def test_a_lookup_retried_while_the_pool_is_full_counts_once() -> None:
    s = make(num_blocks=3, budget=100)
    s.add(request(8, "a"))  # 2 blocks, a third once it grows past 8 tokens
    s.add(request(8, "b"))  # needs 2 blocks: waits
    for _ in range(3):
        assert [name for name, _ in run_step(s)] == ["a"]  # "b" is looked up again each step, never admitted
    assert s.kv.num_queried_tokens == 8


def test_scheduling_advances_computed_tokens_before_the_step_runs() -> None:
    # so the next step can be planned while this one executes
    s = make(budget=8)
    a = request(13, "a")
    s.add(a)
    out = s.schedule()
    assert a.num_computed_tokens == 8 and out.scheduled[0].start == 0 and not out.scheduled[0].samples
    s.update_from_output(out, {})
    out = s.schedule()
    assert a.num_computed_tokens == 13 and out.scheduled[0].start == 8 and out.scheduled[0].samples


def test_a_pinned_request_keeps_its_blocks_until_freed() -> None:
    s = make()
    a = Request("a", list(range(100, 106)), SamplingParams(max_tokens=1), pin_blocks=True, max_num_tokens=64)
    s.add(a)
    run_step(s)
    assert a.status is RequestStatus.FINISHED_PINNED and a.finish_reason is FinishReason.LENGTH
    assert not s.has_unfinished() and s.requests == {"a": a} and s.kv.num_free_blocks == 14
    assert s.free_pinned("a") and not s.free_pinned("a")
    assert a.status is RequestStatus.FINISHED_LENGTH and s.kv.num_free_blocks == 16 and not s.requests


def test_abort_frees_a_pinned_request_too() -> None:
    s = make()
    s.add(Request("a", [1, 2, 3], SamplingParams(max_tokens=1), pin_blocks=True, max_num_tokens=64))
    run_step(s)
    assert s.abort("a") and s.kv.num_free_blocks == 16 and not s.requests


def test_remote_kv_is_reserved_outside_the_batch_then_admitted_as_computed() -> None:
    s = make()
    a = request(6, "a")
    reserved = s.reserve_remote_kv(a)
    assert reserved is not None and len(reserved.block_ids) == 2 and reserved.num_cached_blocks == 0
    assert a.status is RequestStatus.WAITING_FOR_REMOTE_KV and not s.has_unfinished() and s.requests == {"a": a}
    assert s.schedule().is_empty  # nothing runs until the K/V has arrived
    first = s.admit_remote_kv("a", SampledToken(7))
    assert not first.finished and a.output_token_ids == [7] and a.num_computed_tokens == 6
    assert run_step(s) == [("a", 1)]  # only the first token is left to compute


def test_abort_undoes_a_remote_kv_reservation() -> None:
    s = make()
    assert s.reserve_remote_kv(request(6, "a")) is not None
    assert s.abort("a") and s.kv.num_free_blocks == 16 and not s.requests


def test_a_first_token_that_finishes_the_request_frees_its_reservation() -> None:
    s = make()
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=1), max_num_tokens=64)
    assert s.reserve_remote_kv(a) is not None
    out = s.admit_remote_kv("a", SampledToken(9))
    assert out.finish_reason is FinishReason.LENGTH and a.status is RequestStatus.FINISHED_LENGTH
    assert s.kv.num_free_blocks == 16 and not s.requests and not s.has_unfinished()


def test_stop_token_finishes_only_after_min_tokens() -> None:
    s = make()
    a = Request("a", [1, 2, 3], SamplingParams(min_tokens=2, stop_token_ids=[1]), max_num_tokens=64)
    s.add(a)
    assert run_step(s) == [("a", 3)] and a.status is RequestStatus.RUNNING  # token 1, but min_tokens=2
    run_step(s)
    assert a.status is RequestStatus.FINISHED_STOPPED and a.stop_token_id == 1 and a.output_token_ids == [1, 1]
