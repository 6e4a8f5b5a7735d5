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

On one rank every layer here computes what its plain torch counterpart does, bit for bit. A CPU model's linear layers
are replaced after loading by packed ones (engine/layers/cpu_linear.py).
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


class ColumnParallelLinear(nn.Linear):
    """A slice of the output features: `out_features` is this rank's share. No communication."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    """A slice of the input features; the partial outputs are summed over the ranks. The bias is loaded on rank 0
    only (zero elsewhere), so the sum adds it once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, parallel: ParallelContext = SINGLE_RANK
                 ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_reduce(F.linear(x, self.weight, self.bias))


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
    whole [B, vocab] logits: in the lm_head's dtype on one rank, in float32 when the ranks gather them.

    The sampler upcasts wherever it computes (engine/sampler.py) and a 16-bit float's upcast is exact, so it
    samples the same tokens from either; a float32 copy of a batch-256 step's 128k-word logits cost the H200
    ~0.15 ms a decode step (bench/results/engine-speed-2026-12-04.md)."""
    if not parallel.is_parallel:
        return logits[:, :vocab_size]
    return parallel.all_gather(logits.float(), dim=-1)[:, :vocab_size]
