"""The sparse MoE block of Qwen2-MoE, Qwen3-MoE and Mixtral, on one rank or split across a node's ranks.

Routing is transformers': softmax over the router's logits in float32, the top K experts, renormalised when
the model says so, then rounded to the activations' dtype (Qwen; Mixtral keeps float32). Qwen2-MoE adds a
shared expert scaled by sigmoid(shared_expert_gate(x)).

Across ranks (the activations entering the block are the same on every rank, as tensor-parallel attention
leaves them), two layouts, chosen by ParallelContext.expert_parallel:
- TP-sharded experts (default): every rank holds every expert, each with its slice of the intermediate dim,
  runs all of a token's experts on its slice and the partial sums meet in one all-reduce of [T, H]. The shared
  expert is split the same way and joins that all-reduce.
- Expert parallel: rank r holds whole experts r*E/n .. (r+1)*E/n - 1, and the shared expert whole; rank r owns
  (routes, and adds the shared expert for) tokens r*ceil(T/n) onwards. ParallelContext.all2all_backend:
  - "allgather_reducescatter": the all-gather of the tokens is already done (every rank has them all), each
    rank runs its experts on the (token, expert) pairs it holds, and the combine is a reduce-scatter to the
    owners plus an all-gather back, i.e. one all-reduce of [T, H]: the bytes of the TP-sharded layout.
  - "all_to_all": the owner routes its tokens, an all-to-all dispatches each (token, expert) row to the
    expert's rank, a second brings the outputs back, the owner combines them with the routing weights, and an
    all-gather gives every rank every token. About K times the bytes of the above while tokens are replicated;
    the layout for when attention becomes data-parallel and each rank has tokens of its own.
(bench/moe_comm.py measures both.)
"""

from __future__ import annotations

import re

import torch
from torch import nn

from engine.config import ModelConfigError, MoeConfig
from engine.layers.basic import silu_and_mul
from engine.parallel.context import SINGLE_RANK, ParallelContext

# a checkpoint's per-expert tensors: Qwen names (gate/up/down_proj) and Mixtral's (w1 = gate, w3 = up, w2 = down)
_PER_EXPERT = re.compile(r"^experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_SHARED = re.compile(r"^shared_expert\.(gate_proj|up_proj|down_proj)\.weight$")


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, round_weights: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E] -> (weights [T, K] float32, expert ids [T, K]), as transformers routes."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if round_weights:
        weights = weights.to(router_logits.dtype).float()
    return weights, ids


def run_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, fused: bool, expert_start: int = 0, num_experts: int | None = None
                ) -> torch.Tensor:
    """The routed experts of the rows of x: the Triton kernel (GPU) or its torch twin (CPU)."""
    if fused:
        from engine.kernels.moe import fused_moe

        return fused_moe(x, w13, w2, topk_weights, topk_ids, expert_start, num_experts)
    from engine.kernels.reference import fused_moe as torch_fused_moe

    return torch_fused_moe(x, w13, w2, topk_weights, topk_ids, expert_start)


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, moe: MoeConfig, round_weights: bool, fused: bool = False,
                 parallel: ParallelContext = SINGLE_RANK) -> None:
        """round_weights: routing weights rounded to the activations' dtype (Qwen) or kept float32 (Mixtral)."""
        super().__init__()
        self.moe = moe
        self.fused = fused
        self.parallel = parallel
        self.round_weights = round_weights
        self.expert_parallel = parallel.is_parallel and parallel.expert_parallel
        num_ranks = parallel.tp_size
        intermediate = moe.intermediate_size
        if self.expert_parallel and moe.num_experts % num_ranks:
            raise ModelConfigError(f"expert parallelism needs num_experts ({moe.num_experts}) to be a multiple "
                                   f"of the ranks ({num_ranks})")
        if not self.expert_parallel and intermediate % num_ranks:
            raise ModelConfigError(f"the experts' intermediate size ({intermediate}) does not split over "
                                   f"{num_ranks} ranks; try enable_expert_parallel")
        # experts held here and the slice of each expert's intermediate dim
        self.expert_start, self.num_local_experts = (parallel.shard(moe.num_experts) if self.expert_parallel
                                                     else (0, moe.num_experts))
        self.inter_start, self.inter_size = (0, intermediate) if self.expert_parallel else parallel.shard(intermediate)
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)  # the router, on every rank
        # w13: [E_local, 2 * I_local, H] each expert's gate rows then its up rows; w2: [E_local, H, I_local]
        self.w13 = nn.Parameter(torch.empty(self.num_local_experts, 2 * self.inter_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, self.inter_size))
        shared = moe.shared_expert_intermediate_size
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared:
            if not self.expert_parallel and shared % num_ranks:
                raise ModelConfigError(f"the shared expert's intermediate size ({shared}) does not split over "
                                       f"{num_ranks} ranks")
            # TP-sharded: split like the experts (its partial sum joins theirs); expert parallel: whole, for
            # the rank's own tokens
            self.shared_start, shared_size = (0, shared) if self.expert_parallel else parallel.shard(shared)
            self.shared_expert = SharedExpert(hidden_size, shared_size, fused)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H], the same on every rank -> [T, H], the same on every rank."""
        if self.expert_parallel and self.parallel.all2all_backend == "all_to_all":
            return self._forward_all_to_all(x)
        weights, ids = route(self.gate(x), self.moe.num_experts_per_tok, self.moe.norm_topk_prob,
                             self.round_weights)
        # the pairs of this rank's experts (all of them, TP-sharded); a partial sum of every token's output
        out = run_experts(x, self.w13, self.w2, weights, ids, self.fused, self.expert_start, self.moe.num_experts)
        if not self.expert_parallel:
            out = self._add_shared(x, out)  # this rank's slice of the shared expert
        elif self.shared_expert is not None:
            own = self._own_tokens(x.shape[0])  # the whole shared expert, for the tokens this rank owns
            out[own] = self._add_shared(x[own], out[own])
        return self.parallel.all_reduce(out)

    def _own_tokens(self, num_tokens: int) -> slice:
        per_rank = -(-num_tokens // self.parallel.tp_size)
        start = min(self.parallel.tp_rank * per_rank, num_tokens)
        return slice(start, min(start + per_rank, num_tokens))

    def _add_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.shared_expert is None or self.shared_expert_gate is None:
            return out
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def _forward_all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            # the split sizes of an all-to-all are host values: a CUDA graph cannot replay them
            raise RuntimeError("the all_to_all MoE exchange cannot run in a CUDA graph: use enforce_eager "
                               "(--enforce-eager) or all2all_backend='allgather_reducescatter'")
        parallel = self.parallel
        num_ranks, num_local = parallel.tp_size, self.num_local_experts
        num_tokens, hidden = x.shape
        if num_tokens == 0:  # the same on every rank: no collective is skipped by one rank only
            return torch.zeros_like(x)
        per_rank = -(-num_tokens // num_ranks)
        own = x[self._own_tokens(num_tokens)]  # [Ts, H] the tokens this rank routes and combines
        weights, ids = route(self.gate(own), self.moe.num_experts_per_tok, self.moe.norm_topk_prob,
                             self.round_weights)
        top_k = ids.shape[1]
        # dispatch: rows sorted by global expert id, which also groups them by the rank that holds the expert
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        send_rows = own[order // top_k]
        send_counts = torch.zeros(self.moe.num_experts, dtype=torch.long, device=x.device)
        send_counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
        # recv_counts[src, e]: rows rank src sends to this rank's local expert e
        recv_counts = parallel.all_to_all(send_counts).view(num_ranks, num_local)
        send_splits = send_counts.view(num_ranks, num_local).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        recv_rows = parallel.all_to_all(send_rows, recv_splits, send_splits)
        # received rows come grouped by source rank, then by local expert
        local_ids = torch.arange(num_local, device=x.device).repeat(num_ranks)
        local_ids = local_ids.repeat_interleave(recv_counts.reshape(-1))
        ones = torch.ones(local_ids.shape[0], 1, dtype=torch.float32, device=x.device)
        expert_rows = run_experts(recv_rows, self.w13, self.w2, ones, local_ids[:, None], self.fused)
        # combine: the rows come back in send order; each token's K rows summed with its weights in float32
        back = parallel.all_to_all(expert_rows, send_splits, recv_splits)
        pair_rows = torch.empty_like(back)
        pair_rows[order] = back
        own_out = (pair_rows.view(-1, top_k, hidden).float() * weights[..., None]).sum(dim=1).to(x.dtype)
        own_out = self._add_shared(own, own_out)
        padded = own_out.new_zeros(per_rank, hidden)
        padded[:own_out.shape[0]] = own_out
        return parallel.all_gather(padded, dim=0)[:num_tokens]

    # ---- weights ----
    def checkpoint_slots(self) -> set[str]:
        """Every checkpoint tensor (or part of one) this block must be given, whichever rank holds it."""
        slots = {"gate.weight"}
        slots |= {f"experts.{e}.{part}" for e in range(self.moe.num_experts) for part in ("gate", "up", "down")}
        if self.shared_expert is not None:
            slots |= {"shared_expert.gate", "shared_expert.up", "shared_expert.down", "shared_expert_gate.weight"}
        return slots

    def load_checkpoint_weight(self, name: str, tensor: torch.Tensor) -> set[str]:
        """name relative to the block (`experts.3.w1.weight`, `gate.weight`, ...): copies this rank's part and
        returns the slots it fills. Unknown names and wrong shapes are a ModelConfigError."""
        with torch.no_grad():
            if name == "gate.weight":
                _copy(self.gate.weight, tensor, name)
                return {name}
            if match := _PER_EXPERT.match(name):
                expert, part = int(match.group(1)), _PART[match.group(2)]
                if expert >= self.moe.num_experts:
                    raise ModelConfigError(f"checkpoint has expert {expert}; the config says {self.moe.num_experts}")
                self._load_expert(expert, part, tensor, name)
                return {f"experts.{expert}.{part}"}
            if name in ("experts.gate_up_proj", "experts.down_proj"):  # transformers 5's stacked layout
                return self._load_stacked(name, tensor)
            if self.shared_expert is not None and self.shared_expert_gate is not None:
                if name == "shared_expert_gate.weight":
                    _copy(self.shared_expert_gate.weight, tensor, name)
                    return {name}
                if match := _SHARED.match(name):
                    part = _PART[match.group(1)]
                    shared = self.shared_expert
                    size = shared.intermediate_size
                    rows = slice(self.shared_start, self.shared_start + size)
                    full = self.moe.shared_expert_intermediate_size
                    if part == "down":
                        _copy(shared.down_proj.weight, _narrow(tensor, 1, rows, full, name), name)
                    else:
                        offset = 0 if part == "gate" else size
                        _copy(shared.gate_up_proj.weight[offset:offset + size], _narrow(tensor, 0, rows, full, name),
                              name)
                    return {f"shared_expert.{part}"}
        raise ModelConfigError(f"checkpoint tensor {name!r} does not belong to a MoE block")

    def _load_expert(self, expert: int, part: str, tensor: torch.Tensor, name: str) -> None:
        local = expert - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return  # another rank's expert
        rows = slice(self.inter_start, self.inter_start + self.inter_size)
        full = self.moe.intermediate_size
        if part == "down":
            _copy(self.w2[local], _narrow(tensor, 1, rows, full, name), name)
        else:
            offset = 0 if part == "gate" else self.inter_size
            _copy(self.w13[local, offset:offset + self.inter_size], _narrow(tensor, 0, rows, full, name), name)

    def _load_stacked(self, name: str, tensor: torch.Tensor) -> set[str]:
        if tensor.dim() != 3 or tensor.shape[0] != self.moe.num_experts:
            raise ModelConfigError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                                   f"{self.moe.num_experts} experts stacked")
        size = self.moe.intermediate_size
        for expert in range(self.moe.num_experts):
            if name == "experts.down_proj":
                self._load_expert(expert, "down", tensor[expert], name)
            else:
                self._load_expert(expert, "gate", tensor[expert, :size], name)
                self._load_expert(expert, "up", tensor[expert, size:], name)
        parts = ("down",) if name == "experts.down_proj" else ("gate", "up")
        return {f"experts.{e}.{part}" for e in range(self.moe.num_experts) for part in parts}


class SharedExpert(nn.Module):
    """Qwen2-MoE's always-on expert: a SiLU-gated MLP (gate and up fused) of its own intermediate size."""

    def __init__(self, hidden_size: int, intermediate_size: int, fused: bool) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.fused))


def _narrow(tensor: torch.Tensor, dim: int, part: slice, full: int, name: str) -> torch.Tensor:
    """This rank's rows (dim 0) or columns (dim 1) of a checkpoint matrix whose dim `dim` must be `full`."""
    if tensor.dim() != 2 or tensor.shape[dim] != full:
        raise ModelConfigError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the config implies "
                               f"{full} along dim {dim}")
    return tensor.narrow(dim, part.start, part.stop - part.start)


def _copy(dest: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if dest.shape != tensor.shape:
        raise ModelConfigError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the config implies "
                               f"{tuple(dest.shape)}")
    dest.copy_(tensor)
