"""The router's choices over a fixed node table and prefix index: decode node first, the colocation decision,
then the prefill node; the round-robin fallback; no nodes and overload."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import pytest

from engine.hashing import block_hashes
from proxy.routing.directory import NodeView
from proxy.routing.errors import NoHealthyNodes, Overloaded
from proxy.routing.prefix_index import PrefixIndex
from proxy.routing.router import HitTokens, Mode, Router, RouterConfig, RoutingPolicy
from wire import NodeCapacity, NodeLoad, Role
from wire.registry import Tier

BLOCK = 4
SEED = "s"


@dataclass
class Table:
    """A NodeSource: a list of nodes and an index."""

    all: list[NodeView] = field(default_factory=list)
    index: PrefixIndex = field(default_factory=PrefixIndex)

    def nodes(self, role: Role) -> list[NodeView]:
        return [n for n in self.all if n.role is role and not n.draining]


def node(name: str, role: Role, running: int = 0, waiting: int = 0, free: int = 100, queued: int = 0,
         layout: str = "L") -> NodeView:
    return NodeView(f"{name}:1", role, name, layout, NodeCapacity(100, 8, 256, BLOCK),
                     NodeLoad(free, running, waiting, queued), prefix_aware=True, registered=True)


def router(table: Table, **config: object) -> Router:
    return Router(table, RouterConfig(block_size=BLOCK, hash_seed=SEED, **config))  # type: ignore[arg-type]


def warm(table: Table, node_id: str, prompt: list[int], tier: Tier = Tier.DEVICE) -> None:
    table.index.store(node_id, block_hashes(prompt, BLOCK, SEED), tier)


def put_in_store(table: Table, tokens: list[int], layout: str = "L") -> None:
    """The full blocks of `tokens` were just put in the cluster store by some node of `layout`."""
    table.index.add_store_blocks(layout, [(h, time.time()) for h in block_hashes(tokens, BLOCK, SEED)])


LONG = list(range(100, 300))  # 200 tokens: above the default colocation allowance
SHORT = list(range(100, 120))


# ---- the decode node ----
def test_the_decode_node_holding_the_prefix_wins() -> None:
    table = Table([node("d1", Role.DECODE), node("d2", Role.DECODE), node("p1", Role.PREFILL)])
    warm(table, "d2", LONG[:160])
    route = router(table).route(LONG)
    assert route.decode.node_id == "d2" and route.decode_hit_tokens == 160


def test_without_prefix_hits_the_less_loaded_decode_node_wins() -> None:
    table = Table([node("d1", Role.DECODE, running=4), node("d2", Role.DECODE, running=1, free=90),
                   node("p1", Role.PREFILL)])
    assert router(table).route(LONG).decode.node_id == "d2"


def test_a_prefix_hit_does_not_outweigh_a_decode_node_more_than_a_batch_busier() -> None:
    table = Table([node("d1", Role.DECODE, running=8, waiting=7), node("d2", Role.DECODE), node("p1", Role.PREFILL)])
    warm(table, "d1", LONG[:100])  # half the prompt: worth half a batch of seats
    assert router(table).route(LONG).decode.node_id == "d2"


def test_a_node_whose_hashes_differ_from_ours_gets_no_prefix_credit() -> None:
    table = Table([node("d1", Role.DECODE), replace(node("d2", Role.DECODE), prefix_aware=False),
                   node("p1", Role.PREFILL)])
    warm(table, "d2", LONG)
    assert router(table).route(LONG).decode_hit_tokens == 0


# ---- disaggregate or colocate ----
def test_short_prompts_run_on_the_decode_node_alone() -> None:
    table = Table([node("d1", Role.DECODE), node("p1", Role.PREFILL)])
    r = router(table)
    short, long = r.route(SHORT), r.route(LONG)
    assert short.mode is Mode.COLOCATED and short.prefill is None
    assert long.mode is Mode.DISAGGREGATED and long.prefill is not None and long.prefill.node_id == "p1"
    assert r.decision_counts == {"colocated": 1, "disaggregated": 1}


def test_a_big_prefix_hit_on_the_decode_node_makes_a_long_prompt_colocated() -> None:
    table = Table([node("d1", Role.DECODE), node("p1", Role.PREFILL)])
    warm(table, "d1", LONG[:180])
    route = router(table).route(LONG)
    assert route.mode is Mode.COLOCATED and route.decode_hit_tokens == 180


def test_the_colocation_allowance_shrinks_as_the_decode_node_fills() -> None:
    prompt = SHORT + SHORT  # 40 tokens, under the 64-token allowance of an idle node
    idle = Table([node("d1", Role.DECODE), node("p1", Role.PREFILL)])
    busy = Table([node("d1", Role.DECODE, running=6), node("p1", Role.PREFILL)])  # 3/4 of its seats: 16 tokens
    assert router(idle).route(prompt).mode is Mode.COLOCATED
    assert router(busy).route(prompt).mode is Mode.DISAGGREGATED


def test_colocate_max_tokens_zero_always_disaggregates() -> None:
    table = Table([node("d1", Role.DECODE), node("p1", Role.PREFILL)])
    warm(table, "d1", SHORT)
    assert router(table, colocate_max_tokens=0).route(SHORT).mode is Mode.DISAGGREGATED


def test_without_a_usable_prefill_node_the_decode_node_prefills() -> None:
    no_prefill = Table([node("d1", Role.DECODE)])
    other_layout = Table([node("d1", Role.DECODE), node("p1", Role.PREFILL, layout="other")])
    saturated = Table([node("d1", Role.DECODE), node("p1", Role.PREFILL, queued=8 * 256)])
    for table in (no_prefill, other_layout, saturated):
        route = router(table).route(LONG)
        assert route.mode is Mode.COLOCATED and route.prefill is None


# ---- the prefill node ----
def test_the_prefill_node_with_the_prefix_or_the_shorter_queue_wins() -> None:
    table = Table([node("d1", Role.DECODE), node("p1", Role.PREFILL), node("p2", Role.PREFILL)])
    warm(table, "p2", LONG[:120])
    route = router(table).route(LONG)
    assert route.prefill is not None and route.prefill.node_id == "p2" and route.prefill_hit_tokens == 120
    table.all[2] = node("p2", Role.PREFILL, queued=1000)  # its hit saves 120 tokens, its queue costs 1000
    assert router(table).route(LONG).prefill.node_id == "p1"  # type: ignore[union-attr]


def test_the_prefill_node_must_share_the_decode_nodes_kv_layout() -> None:
    table = Table([node("d1", Role.DECODE), node("p1", Role.PREFILL, layout="other"), node("p2", Role.PREFILL)])
    warm(table, "p1", LONG)
    assert router(table).route(LONG).prefill.node_id == "p2"  # type: ignore[union-attr]


def test_requests_in_flight_spread_a_burst_before_the_next_load_report() -> None:
    table = Table([node("d1", Role.DECODE), node("p1", Role.PREFILL), node("p2", Role.PREFILL)])
    r = router(table)
    first = r.route(LONG)
    assert first.prefill is not None
    with r.prefilling(first.prefill, len(LONG)), r.decoding(first.decode):
        second = r.route(LONG)
        assert second.prefill is not None and second.prefill.node_id != first.prefill.node_id
    assert r.route(LONG).prefill.node_id == first.prefill.node_id  # type: ignore[union-attr]


def test_a_retry_prefers_another_prefill_node_then_the_same() -> None:
    table = Table([node("d1", Role.DECODE), node("p1", Role.PREFILL), node("p2", Role.PREFILL)])
    r = router(table)
    route = r.route(LONG)
    assert route.prefill is not None
    other = r.another_prefill(route, route.decode, {route.prefill.address})
    assert other is not None and other.address != route.prefill.address
    again = r.another_prefill(route, route.decode, {"p1:1", "p2:1"})
    assert again is not None  # every one failed once: the best is tried again rather than none
    assert r.another_decode({"d1:1"}) is None


# ---- KV tiers ----
EARLIER = LONG  # turn 1's prompt: 200 tokens, computed on p1
ANSWER = list(range(500, 540))  # its answer: 40 tokens, generated on the decode node and put in the store by it
FOLLOW_UP = EARLIER + ANSWER + list(range(600, 620))  # turn 2: 260 tokens, 240 of them in full blocks seen before


def turn_two_table(p1_queued: int, store: bool = True) -> Table:
    table = Table([node("d1", Role.DECODE), node("p1", Role.PREFILL, queued=p1_queued), node("p2", Role.PREFILL),
                   node("q1", Role.PREFILL, layout="other")])
    warm(table, "p1", EARLIER)
    if store:
        put_in_store(table, EARLIER)  # p1 put the prompt after its first token
        put_in_store(table, EARLIER + ANSWER)  # the decode node put prompt and answer when it finished
    return table


def test_a_follow_up_turn_scores_the_answers_store_blocks_on_every_prefill_node_of_the_layout() -> None:
    r = router(turn_two_table(p1_queued=0))
    route = r.route(FOLLOW_UP)
    assert route.mode is Mode.DISAGGREGATED and route.decode_hit == HitTokens(store=240)
    # both prefill nodes' hits cover the answer: p1 its pool's 200 prompt tokens then the store's 40 answer tokens
    assert route.prefill is not None and route.prefill.node_id == "p1"
    assert route.prefill_hit == HitTokens(device=200, store=40)
    assert r.another_prefill(route, route.decode, {"p1:1"}).node_id == "p2"  # type: ignore[union-attr]


@pytest.mark.parametrize(("p1_queued", "store", "chosen"), [
    (50, True, "p1"),  # p1's edge is the store's reload of its 200 pool tokens: 0.3 x 200 = 60 > 50 queued
    (100, True, "p2"),  # 100 queued tokens outweigh it: p2 gets the whole history from the store
    (100, False, "p1"),  # without the store, p1 alone holds the 200 tokens: worth more than 100 queued
])
def test_a_busy_prefill_node_that_computed_the_prompt_loses_to_one_with_the_store_hit(
        p1_queued: int, store: bool, chosen: str) -> None:
    # score_P: p1 (queued + 260 - 200 - 0.7 x 40) = queued + 32 tokens; p2 (260 - 0.7 x 240) = 92 (no store: 260)
    route = router(turn_two_table(p1_queued, store)).route(FOLLOW_UP)
    assert route.prefill is not None and route.prefill.node_id == chosen


def test_a_pool_hit_beats_a_host_hit_beats_a_store_hit_of_the_same_length() -> None:
    table = Table([node("d1", Role.DECODE), node("d2", Role.DECODE), node("p1", Role.PREFILL),
                   node("p2", Role.PREFILL), node("p3", Role.PREFILL)])
    put_in_store(table, FOLLOW_UP[:240])
    warm(table, "d2", FOLLOW_UP[:240])
    warm(table, "p3", FOLLOW_UP[:240])
    warm(table, "p2", FOLLOW_UP[:240], Tier.HOST)
    r = router(table, colocate_max_tokens=0)
    route = r.route(FOLLOW_UP)
    assert route.decode.node_id == "d2" and route.decode_hit == HitTokens(device=240)
    assert route.prefill.node_id == "p3" and route.prefill_hit == HitTokens(device=240)  # type: ignore[union-attr]
    table.all = [n for n in table.all if n.node_id not in ("d2", "p3")]
    route = r.route(FOLLOW_UP)
    assert route.decode_hit == HitTokens(store=240)
    assert route.prefill.node_id == "p2" and route.prefill_hit == HitTokens(host=240)  # type: ignore[union-attr]


def test_host_and_store_hits_save_their_share_and_need_fresh_pool_blocks() -> None:
    r = router(Table(), host_hit_cost=0.25, store_hit_cost=0.5)
    d = node("d", Role.DECODE)  # 100 blocks of 4 tokens, all free, 8 seats, none taken
    # a 200-token prompt needs 50 blocks; a pool hit of 160 tokens leaves 10 to allocate, a host or store hit none
    assert r.decode_score(d, 200, HitTokens(device=160)) == pytest.approx(10 / 100 - 160 / 200)
    assert r.decode_score(d, 200, HitTokens(host=160)) == pytest.approx(50 / 100 - 0.75 * 160 / 200)
    assert r.decode_score(d, 200, HitTokens(device=80, store=80)) == pytest.approx(30 / 100 - (80 + 40) / 200)
    p = node("p", Role.PREFILL, queued=56)  # 256 tokens a step
    assert r.prefill_score(p, 200, HitTokens(40, 80, 40)) == pytest.approx((56 + 200 - 40 - 60 - 20) / 256)


def test_a_hit_cost_is_a_fraction_of_computing() -> None:
    with pytest.raises(ValueError, match="store_hit_cost"):
        RouterConfig(store_hit_cost=1.5)
    with pytest.raises(ValueError, match="host_hit_cost"):
        RouterConfig(host_hit_cost=-0.1)


def test_a_full_hit_in_any_tier_still_leaves_the_last_token_to_compute() -> None:
    table = Table([node("d1", Role.DECODE), node("p1", Role.PREFILL)])
    warm(table, "p1", EARLIER[:100])
    put_in_store(table, EARLIER)  # 200 tokens: 50 full blocks, the whole prompt
    route = router(table, colocate_max_tokens=0).route(EARLIER)
    assert route.prefill_hit == HitTokens(device=100, store=99)


# ---- health and overload ----
def test_no_decode_node_is_no_healthy_nodes() -> None:
    with pytest.raises(NoHealthyNodes):
        router(Table([node("p1", Role.PREFILL)])).route(LONG)
    draining = replace(node("d1", Role.DECODE), draining=True)
    with pytest.raises(NoHealthyNodes):
        router(Table([draining, node("p1", Role.PREFILL)])).route(LONG)


def test_every_decode_node_saturated_is_overloaded() -> None:
    table = Table([node("d1", Role.DECODE, running=8, waiting=8), node("d2", Role.DECODE, running=8, waiting=9),
                   node("p1", Role.PREFILL)])
    with pytest.raises(Overloaded) as e:
        router(table).route(SHORT)
    assert e.value.retry_after_s > 0


# ---- round robin ----
def test_round_robin_takes_nodes_in_turn_and_disaggregates_while_a_prefill_node_is_up() -> None:
    table = Table([node("d1", Role.DECODE), node("d2", Role.DECODE), node("p1", Role.PREFILL),
                   node("p2", Role.PREFILL)])
    warm(table, "d1", SHORT)
    r = router(table, policy=RoutingPolicy.ROUND_ROBIN)
    routes = [r.route(SHORT) for _ in range(4)]
    assert [x.decode.node_id for x in routes] == ["d1", "d2", "d1", "d2"]
    assert [x.prefill.node_id for x in routes if x.prefill] == ["p1", "p2", "p1", "p2"]
    assert all(x.mode is Mode.DISAGGREGATED for x in routes) and r.decision_counts == {"disaggregated": 4}
    # no prefill node: the decode node prefills (as prefix_load does), rather than a 503
    alone = router(Table([node("d1", Role.DECODE)]), policy=RoutingPolicy.ROUND_ROBIN).route(LONG)
    assert alone.mode is Mode.COLOCATED and alone.prefill is None and alone.decode.node_id == "d1"
