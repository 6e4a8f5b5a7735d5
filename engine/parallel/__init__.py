"""Tensor and expert parallelism: who this rank is among its node's ranks and the collectives between them."""

from engine.parallel.context import SINGLE_RANK, ParallelContext

__all__ = ["SINGLE_RANK", "ParallelContext"]
