"""The Llama family as one decoder: Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm, explicit head_dim),
and their mixture-of-experts kin Qwen2-MoE, Qwen3-MoE and Mixtral (a SparseMoeBlock where the MLP was).

Inputs are flat: every scheduled token of every sequence in one [T] row, with its position; the paged KV cache
and the step's AttentionMetadata say which tokens see which. Module names follow transformers' checkpoints,
except q/k/v and gate/up, which are fused (the loader stacks them).

Tensor parallelism (engine/layers/linear.py): a rank holds its heads' q/k/v rows and o_proj columns, and its
slice of the MLP's intermediate features; o_proj and down_proj sum over the ranks (one all-reduce each per
layer). On one rank (`SINGLE_RANK`) every layer is a plain torch one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine.config import ModelConfig
from engine.kernels import hopper_mlp
from engine.layers import cpu_kernels
from engine.layers.attention import AttentionBackend, AttentionMetadata, KVCacheLayer
from engine.layers.basic import RMSNorm, RotaryEmbedding, linear, silu_and_mul
from engine.layers.linear import (
    ColumnParallelLinear,
    HeadSplit,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_logits,
    vocab_shard,
)
from engine.layers.moe import SparseMoeBlock
from engine.parallel.context import SINGLE_RANK, ParallelContext


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, parallel: ParallelContext = SINGLE_RANK) -> None:
        super().__init__()
        split = HeadSplit.of(cfg.num_heads, cfg.num_kv_heads, parallel.tp_rank, parallel.tp_size)
        self.num_heads = split.num_q_heads  # this rank's
        self.num_kv_heads = split.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, cfg.o_proj_bias, parallel)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, rotary.fused) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, rotary.fused) if cfg.qk_norm else None
        self.rotary = rotary
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: KVCacheLayer,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = linear(self.qkv_proj, x, self.rotary.fused).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cache = KVCacheLayer(*kv_cache)  # a plain (k, v) pair reads as a cache without scales
        # RoPE and the K/V store are one Triton launch with the GPU kernels, one C++ pass on the CPU (an FP8 cache
        # quantizes in the backend's store)
        kv_stored = cache.k_scale is None and (
            self.rotary.fused or (cache.k.dtype == q.dtype and cpu_kernels.layer_ops_serve(q, float32=True)))
        if kv_stored and self.rotary.fused:
            from engine.kernels.kv_store import rotary_and_store_kv  # needs triton: imported where it runs

            q, k = rotary_and_store_kv(positions, q, k, v, self.rotary.cos_sin, cache.k, cache.v, meta.slot_mapping)
        elif kv_stored:
            q, k = cpu_kernels.rotary_and_store_kv(positions, q, k, v, self.rotary.cos_sin, cache.k, cache.v,
                                                   meta.slot_mapping)
        else:
            q, k = self.rotary(positions, q, k)
        out = backend.forward(q, k, v, cache.k, cache.v, meta, self.scale, k_scale=cache.k_scale,
                              v_scale=cache.v_scale, kv_stored=kv_stored)
        return linear(self.o_proj, out.reshape(num_tokens, self.q_size), self.rotary.fused)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, fused: bool, parallel: ParallelContext = SINGLE_RANK) -> None:
        super().__init__()
        _, intermediate = parallel.shard(cfg.intermediate_size)
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, 2 * intermediate, bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(intermediate, cfg.hidden_size, cfg.mlp_bias, parallel)
        self.fused = fused
        # the Hopper kernel of engine/kernels/hopper_mlp.py; the runner turns it on
        self.gate_up_silu = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the flag first (on the CPU the projections may be packed layers with no `weight`); the runner set it
        # only where hopper_mlp.device_supported, so only the shape is left to check here
        if (self.gate_up_silu and self.gate_up_proj.bias is None
                and hopper_mlp.shape_supported(x, self.gate_up_proj.weight)):
            hidden = hopper_mlp.gate_up_silu(x, self.gate_up_proj.weight)
        else:
            gate_up = self.gate_up_proj(x)  # cuBLAS reads this wide one at the bandwidth already, even for one token
            if self.fused and x.shape[0] == 1:
                return linear(self.down_proj, gate_up, self.fused, silu_mul_input=True)
            hidden = silu_and_mul(gate_up, self.fused)
        return self.down_proj(hidden)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, parallel: ParallelContext = SINGLE_RANK,
                 layer_index: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, rotary, parallel)
        self.mlp: nn.Module
        if cfg.moe is not None and cfg.moe.is_sparse_layer(layer_index):
            self.mlp = SparseMoeBlock(cfg.hidden_size, cfg.moe, round_weights=cfg.architecture != "MixtralForCausalLM",
                                      fused=rotary.fused, parallel=parallel)
        else:
            self.mlp = MLP(cfg, rotary.fused, parallel)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rotary.fused)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rotary.fused)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_cache: KVCacheLayer, meta: AttentionMetadata, backend: AttentionBackend
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream travels beside the layer output so each add fuses into the next norm:
        returns (mlp_out, residual) with the block's output = mlp_out + residual."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(h, positions, kv_cache, meta, backend)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, fused: bool, parallel: ParallelContext = SINGLE_RANK
                 ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, parallel)
        rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions, fused)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary, parallel, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, fused_kernels: bool = False,
                 parallel: ParallelContext = SINGLE_RANK) -> None:
        """fused_kernels: RMSNorm, RoPE, SiLU-and-mul and the MoE experts as Triton kernels (the GPU path).
        parallel: this rank among the node's tensor-parallel ranks."""
        super().__init__()
        self.config = cfg
        self.parallel = parallel
        self.model = DecoderModel(cfg, max_positions, fused_kernels, parallel)
        _, vocab_rows = vocab_shard(cfg.vocab_size, parallel)
        self.lm_head = ColumnParallelLinear(cfg.hidden_size, vocab_rows, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: Sequence[KVCacheLayer], meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, kv_cache, meta, backend)
        assert residual is not None, "a model has at least one layer"
        return self.model.norm.add_and_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, hidden] -> [B, vocab] logits on every rank (in the model's dtype on one rank: gather_logits)."""
        return gather_logits(self.lm_head(hidden), self.config.vocab_size, self.parallel)
