"""Ray gives each node its GPU (or its share of one): a real local Ray told it has two GPUs (Ray's resource
accounting needs no real device), the pool's placement code, and the environment each node's actor would start
its process with."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import ray
from ray.util.placement_group import placement_group_table, remove_placement_group

from cluster.pools import Node, NodeLaunch, PoolManager


@pytest.fixture(scope="module")
def ray_with_two_gpus() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=False)
        try:
            yield
        finally:
            ray.shutdown()


def placed(gpus_per_rank: float, count: int, tp: int = 1) -> tuple[PoolManager, list[Node]]:
    launch = NodeLaunch(model="/m", registry_url="redis://127.0.0.1:1/0", cpus_per_node=0.25,
                        gpus_per_rank=gpus_per_rank, tp=tp)
    pools = PoolManager(launch, {"prefill": 0, "decode": 0})
    nodes = [Node(f"decode-{i}", "decode") for i in range(count)]

    async def place_all() -> None:
        for node in nodes:
            await pools.place(node, timeout_s=60)

    asyncio.run(place_all())
    return pools, nodes


def visible_gpus(node: Node) -> str:
    return str(ray.get(node.actor.environment.remote(), timeout=30)["CUDA_VISIBLE_DEVICES"])


def release(nodes: list[Node]) -> None:
    for node in nodes:
        for actor in [node.actor, *node.rank_holders]:
            if actor is not None:
                ray.kill(actor)
        if node.placement is not None:
            remove_placement_group(node.placement)


def test_each_node_gets_a_whole_gpu_of_its_own(ray_with_two_gpus: None) -> None:
    pools, nodes = placed(1.0, 2)
    try:
        assert pools.room() == 2
        assert sorted(visible_gpus(n) for n in nodes) == ["0", "1"]
    finally:
        release(nodes)


def test_half_gpu_nodes_are_packed_two_on_each_gpu_and_a_fifth_finds_no_room(ray_with_two_gpus: None) -> None:
    pools, nodes = placed(0.5, 4)
    extra = Node("decode-4", "decode")
    try:
        assert pools.room() == 4
        assert sorted(visible_gpus(n) for n in nodes) == ["0", "0", "1", "1"]
        with pytest.raises(TimeoutError, match="no room to place decode-4"):
            asyncio.run(pools.place(extra, timeout_s=2))
    finally:
        release([*nodes, extra])


def test_a_tp_node_is_one_strict_pack_placement_group_with_a_bundle_per_rank(ray_with_two_gpus: None) -> None:
    pools, nodes = placed(1.0, 1, tp=2)
    try:
        table = placement_group_table(nodes[0].placement)
        assert table["strategy"] == "STRICT_PACK"
        assert list(table["bundles"].values()) == [{"CPU": 0.125, "GPU": 1.0}] * 2
        # the node process sees both ranks' GPUs, its own first (rank r runs on cuda:r)
        assert sorted(visible_gpus(nodes[0]).split(",")) == ["0", "1"]
        assert pools.room() == 1
    finally:
        release(nodes)
