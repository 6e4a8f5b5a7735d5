"""The GPUs of a tensor-parallel node's other ranks.

A TP node is one placement group, one bundle per rank, STRICT_PACK (one machine: its ranks talk over NCCL and
loopback). The node's actor sits in bundle 0 and sees bundle 0's GPU only; the node process starts its other
ranks itself (engine/parallel/executor.py), so each other bundle's GPU is held by a small actor that tells which
GPU Ray gave it, and the node process is shown all of them, in rank order (rank r uses cuda:r).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


class RankReservation:
    """Holds one rank's bundle while the node runs; says which GPUs Ray gave it."""

    def gpu_ids(self) -> list[str]:
        return [str(i) for i in ray.get_gpu_ids()]


_RESERVATION = ray.remote(max_restarts=0)(RankReservation)


async def reserve_rank_gpus(placement: PlacementGroup, bundles: Sequence[dict[str, float]], timeout_s: float
                            ) -> tuple[list[Any], list[str]]:
    """(the reservation actors of bundles 1.., the GPU ids they hold in rank order); nothing on CPU nodes."""
    if len(bundles) < 2 or not bundles[0].get("GPU"):
        return [], []
    holders = [_RESERVATION.options(  # type: ignore[attr-defined]
        num_cpus=0, num_gpus=bundle["GPU"],
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=index),
    ).remote() for index, bundle in enumerate(bundles) if index > 0]
    ids = await asyncio.wait_for(asyncio.gather(*(h.gpu_ids.remote() for h in holders)),  # type: ignore[attr-defined]
                                 timeout=max(timeout_s, 1))
    return holders, [gpu for rank_ids in ids for gpu in rank_ids]
