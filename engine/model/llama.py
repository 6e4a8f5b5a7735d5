"""The Llama family as one decoder: Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm, explicit head_dim).

Inputs are flat: every scheduled token of every sequence in one [T] row, with its position; the paged KV cache
and the step's AttentionMetadata say which tokens see which. Module names follow transformers' checkpoints,
except q/k/v and gate/up, which are fused (the loader stacks them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers.attention import AttentionBackend, AttentionMetadata, KVCacheLayer
from engine.layers.basic import RMSNorm, RotaryEmbedding, silu_and_mul


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, rotary.fused) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, rotary.fused) if cfg.qk_norm else None
        self.rotary = rotary
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: KVCacheLayer,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        cache = KVCacheLayer(*kv_cache)  # a plain (k, v) pair reads as a cache without scales
        out = backend.forward(q, k, v, cache.k, cache.v, meta, self.scale, k_scale=cache.k_scale,
                              v_scale=cache.v_scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, fused: bool) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.fused))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, rotary)
        self.mlp = MLP(cfg, rotary.fused)
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
    def __init__(self, cfg: ModelConfig, max_positions: int, fused: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions, fused)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, fused_kernels: bool = False) -> None:
        """fused_kernels: RMSNorm, RoPE and SiLU-and-mul as Triton kernels (the GPU path)."""
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, max_positions, fused_kernels)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
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
        return self.lm_head(hidden).float()
