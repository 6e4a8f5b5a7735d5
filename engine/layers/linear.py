"""Tensor-parallel linear layers, embedding and lm_head, and which slice of a checkpoint tensor each rank holds.

Megatron's split: a column-parallel layer holds a slice of the output features and needs no communication; a
row-parallel layer holds the matching slice of the input features and sums the partial outputs over the ranks
(one all-reduce). Attention is column (q/k/v: the rank's heads) then row (o_proj); the MLP is column (gate/up)
then row (down): one all-reduce per attention block and one per MLP block.

KV heads: with at least as many KV heads as ranks each rank holds `num_kv_heads / tp` of them; with fewer, each KV
head is replicated on `tp / num_kv_heads` consecutive ranks, the ranks whose query heads it serves.

The vocabulary is split in `ceil(vocab / tp)` rows per rank (the last rank's slice padded with zero rows): the
embedding looks up the rank's ids and sums over the ranks (one all-reduce); the lm_head (a column-parallel layer)
computes the rank's logits, which `gather_logits` gathers (one all-gather).

On one rank every layer here computes what its plain torch counterpart does; on a GPU bit for bit, on a CPU in
float32 for a few rows by another product order (`dense_linear`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel.context import SINGLE_RANK, ParallelContext


@dataclass(frozen=True)
class HeadSplit:
    """Which attention heads one rank holds: query heads [q_start, q_start + num_q_heads), KV heads
    [kv_start, kv_start + num_kv_heads)."""

    q_start: int
    num_q_heads: int
    kv_start: int
    num_kv_heads: int

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, tp_rank: int, tp_size: int) -> HeadSplit:
        if num_heads % tp_size:
            raise ValueError(f"{num_heads} attention heads do not split over {tp_size} tensor-parallel ranks")
        if num_kv_heads >= tp_size:
            if num_kv_heads % tp_size:
                raise ValueError(f"{num_kv_heads} KV heads do not split over {tp_size} tensor-parallel ranks")
            kv_per_rank = num_kv_heads // tp_size
            kv_start = tp_rank * kv_per_rank
        else:
            if tp_size % num_kv_heads:
                raise ValueError(f"{num_kv_heads} KV heads cannot be replicated evenly over {tp_size} ranks")
            kv_per_rank = 1
            kv_start = tp_rank // (tp_size // num_kv_heads)
        q_per_rank = num_heads // tp_size
        return cls(tp_rank * q_per_rank, q_per_rank, kv_start, kv_per_rank)


def vocab_shard(vocab_size: int, parallel: ParallelContext) -> tuple[int, int]:
    """(start, rows) of this rank's vocabulary slice; `rows` is the same on every rank (the last one padded)."""
    rows = -(-vocab_size // parallel.tp_size)
    return parallel.tp_rank * rows, rows


# MKL's float32 GEMM runs x @ W^T for a few rows (a decode step's tokens) far below the memory bandwidth, and
# the same product as (W @ x^T)^T much closer to it: SmolLM2's lm_head [8, 576] x [576, 49152] took 25 ms as
# x @ W^T (4.5 GB/s, against 24 GB/s of DRAM read on the 2-core bench box) and 11 ms as W @ x^T; its other
# layers 0.6-0.9x, a whole decode step at batch 8 0.79x (bench/results/engine-speed-2026-12-03.md, "Night").
# Past 64 rows the two orders were even on the down projection, so the ordinary product takes over there.
CPU_FEW_ROWS = 64


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias); for 2..CPU_FEW_ROWS rows of float32 on a CPU, computed as (weight @ x^T)^T
    (the same sums, in MKL's other kernel order: equal to F.linear within float32 rounding)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and 1 < x.shape[0] <= CPU_FEW_ROWS:
        out = torch.mm(weight, x.t()).t().contiguous()
        return out if bias is None else out.add_(bias)
    return F.linear(x, weight, bias)


class ColumnParallelLinear(nn.Linear):
    """A slice of the output features: `out_features` is this rank's share. No communication."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    """A slice of the input features; the partial outputs are summed over the ranks. The bias is loaded on rank 0
    only (zero elsewhere), so the sum adds it once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, parallel: ParallelContext = SINGLE_RANK
                 ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_reduce(dense_linear(x, self.weight, self.bias))


class VocabParallelEmbedding(nn.Module):
    """The rank's rows of the embedding table; ids of other ranks' rows look up zeros, and the ranks' lookups are
    summed."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelContext = SINGLE_RANK) -> None:
        super().__init__()
        self.parallel = parallel
        self.vocab_start, rows = vocab_shard(vocab_size, parallel)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.parallel.is_parallel:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0.0)
        return self.parallel.all_reduce(out)


def gather_logits(logits: torch.Tensor, vocab_size: int, parallel: ParallelContext) -> torch.Tensor:
    """The lm_head (a ColumnParallelLinear over the rank's vocabulary rows) gives [B, rows]; every rank gets the
    whole [B, vocab] logits, in float32."""
    return parallel.all_gather(logits.float(), dim=-1)[:, :vocab_size]
