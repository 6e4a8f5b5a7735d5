"""ParallelContext: the one object a model layer asks about parallelism.

A layer never reads torch.distributed's global state: it is given the context, so a single-rank model (the
default, `SINGLE_RANK`) runs without any process group, and the same layer code runs sharded when a node has
several tensor-parallel ranks. Expert parallelism reuses the tensor-parallel ranks (as vLLM's
`enable_expert_parallel` does): experts are split across them instead of every expert's weights being split.

Every collective goes through here, and is counted (`CommStats`): what tensor parallelism costs per step is
measured, not estimated (bench/tp_comm.py).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class CommStats:
    """Collectives this rank took part in, and the bytes of its own tensors in them (the payload it sends)."""

    num_collectives: int = 0
    num_bytes: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        self.num_collectives += 1
        self.num_bytes += tensor.numel() * tensor.element_size()
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1

    def reset(self) -> None:
        self.num_collectives, self.num_bytes, self.by_kind = 0, 0, {}


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
    # a gloo group of the same ranks for host-side messages (step commands, objects); the device group on CPU
    cpu_group: Any = None
    stats: CommStats = field(default_factory=CommStats, compare=False)

    def __post_init__(self) -> None:
        assert 0 <= self.tp_rank < self.tp_size, f"rank {self.tp_rank} outside a group of {self.tp_size}"
        assert self.tp_size == 1 or self.group is not None, "several ranks need a process group"

    @property
    def is_parallel(self) -> bool:
        return self.tp_size > 1

    @property
    def is_driver(self) -> bool:
        """Rank 0: it schedules and samples; the other ranks execute the steps it broadcasts."""
        return self.tp_rank == 0

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

        self.stats.add("all_to_all", x)
        rows = sum(output_splits) if output_splits is not None else x.shape[0]
        out = x.new_empty((rows, *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=self.group)
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place; identity on one rank."""
        if self.is_parallel:
            import torch.distributed as dist

            self.stats.add("all_reduce", x)
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in rank order; identity on one rank."""
        if not self.is_parallel:
            return x
        import torch.distributed as dist

        self.stats.add("all_gather", x)
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place (the other ranks pass a tensor of the same shape and dtype)."""
        if self.is_parallel:
            import torch.distributed as dist

            self.stats.add("broadcast", x)
            dist.broadcast(x, src=0, group=self.group)
        return x

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's picklable `obj` on every rank (over the host group: step commands, results of calls)."""
        if not self.is_parallel:
            return obj
        import torch.distributed as dist

        holder = [obj]
        dist.broadcast_object_list(holder, src=0, group=self.cpu_group or self.group)
        self.stats.by_kind["broadcast_object"] = self.stats.by_kind.get("broadcast_object", 0) + 1
        self.stats.num_collectives += 1
        if self.is_driver:  # what broadcast_object_list sends: the pickle and its length (int64)
            self.stats.num_bytes += len(pickle.dumps(obj)) + 8
        return holder[0]

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` on rank 0, in rank order (None on the other ranks)."""
        if not self.is_parallel:
            return [obj]
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.tp_size if self.is_driver else None
        dist.gather_object(obj, out, dst=0, group=self.cpu_group or self.group)
        return out

    def gather_all_ints(self, value: int) -> list[int]:
        """Every rank's `value` on every rank, in rank order (host group)."""
        if not self.is_parallel:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * self.tp_size
        dist.all_gather_object(out, value, group=self.cpu_group or self.group)
        return [int(v) for v in out]


SINGLE_RANK = ParallelContext()
