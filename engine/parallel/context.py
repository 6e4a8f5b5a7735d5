"""ParallelContext: the one object a model layer asks about parallelism.

A layer never reads torch.distributed's global state: it is given the context, so a single-rank model (the
default, `SINGLE_RANK`) runs without any process group, and the same layer code runs sharded when a node has
several tensor-parallel ranks. Expert parallelism reuses the tensor-parallel ranks (as vLLM's
`enable_expert_parallel` does): experts are split across them instead of every expert's weights being split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1
    expert_parallel: bool = False
    # how expert parallelism moves tokens to the experts' ranks and back (vLLM's all2all_backend):
    # "allgather_reducescatter" or "all_to_all" (engine/layers/moe.py)
    all2all_backend: str = "allgather_reducescatter"
    # the torch.distributed group of this node's ranks; None when tp_size == 1
    group: Any = None

    def __post_init__(self) -> None:
        assert 0 <= self.tp_rank < self.tp_size, f"rank {self.tp_rank} outside a group of {self.tp_size}"
        assert self.tp_size == 1 or self.group is not None, "several ranks need a process group"

    @property
    def is_parallel(self) -> bool:
        return self.tp_size > 1

    def shard(self, total: int) -> tuple[int, int]:
        """(start, size) of this rank's even slice of `total` items (heads, columns, experts)."""
        assert total % self.tp_size == 0, f"{total} does not split evenly over {self.tp_size} ranks"
        size = total // self.tp_size
        return self.tp_rank * size, size

    def all_to_all(self, x: torch.Tensor, output_splits: list[int] | None = None,
                   input_splits: list[int] | None = None) -> torch.Tensor:
        """Rows input_splits[r] of `x` (in order) go to rank r; returns the rows every rank sent here, in rank
        order (output_splits[r] from rank r). Splits None: equal shares. Identity on one rank."""
        if not self.is_parallel:
            return x
        import torch.distributed as dist

        rows = sum(output_splits) if output_splits is not None else x.shape[0]
        out = x.new_empty((rows, *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=self.group)
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place; identity on one rank."""
        if self.is_parallel:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in rank order; identity on one rank."""
        if not self.is_parallel:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


SINGLE_RANK = ParallelContext()
