"""Engine configuration: what the user chose (EngineConfig) and what the model says (ModelConfig): a Hugging Face
directory's config.json, or a GGUF file's metadata (engine/gguf_config.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.spec_decode.config import SpeculativeConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")
ALL2ALL_BACKENDS = ("allgather_reducescatter", "all_to_all")
MOE_ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
# vLLM's names for the KV cache's storage: auto (the model's dtype) or FP8 e4m3 with per-row power-of-two scales
# (engine/layers/kv_fp8.py); "fp8" means e4m3, as in vLLM
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
# auto: CUDA when there is one, else CPU. Whether the device exists is checked when the engine starts
# (engine/device.py), so a config can be written on a machine without it.
DEVICE_FORM = re.compile(r"^(auto|cpu|cuda(:[0-9]+)?)$")
DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


class ModelConfigError(ValueError):
    """The model directory is missing, incomplete or describes a model we cannot run."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP as transformers defines it for Qwen2-MoE, Qwen3-MoE and Mixtral: softmax over
    the router's logits, the top `num_experts_per_tok` experts, their weights renormalised to sum to one when
    `norm_topk_prob` (always for Mixtral), plus (Qwen2-MoE) a shared expert scaled by sigmoid(its gate)."""

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int  # of each routed expert (`moe_intermediate_size`; Mixtral's `intermediate_size`)
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    # a layer is sparse when it is not in mlp_only_layers and (index + 1) is a multiple of decoder_sparse_step;
    # the others keep a dense MLP of the model's `intermediate_size`
    decoder_sparse_step: int = 1
    mlp_only_layers: frozenset[int] = frozenset()

    def is_sparse_layer(self, layer_index: int) -> bool:
        return layer_index not in self.mlp_only_layers and (layer_index + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    eos_token_ids: frozenset[int]
    bos_token_id: int | None
    config_dtype: str | None
    moe: MoeConfig | None = None  # None: every layer has a dense MLP

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        """A Hugging Face model directory, a .gguf file, or a directory holding one .gguf (and no config.json)."""
        from engine.gguf_config import find_gguf_file, gguf_model_config  # torch-free; gguf only when needed

        path = Path(path)
        gguf_file = find_gguf_file(path)
        if gguf_file is not None:
            return gguf_model_config(gguf_file)
        config_file = path / "config.json"
        if not path.is_dir():
            raise ModelConfigError(f"model path {str(path)!r} is not a directory")
        if not config_file.is_file():
            raise ModelConfigError(f"model path {str(path)!r} has no config.json")
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{config_file}: not valid JSON ({e})") from e
        if not isinstance(raw, dict):
            raise ModelConfigError(f"{config_file}: expected a JSON object")
        return cls.from_dict(path, raw)

    @classmethod
    def from_dict(cls, path: Path, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelConfigError(
                f"unsupported architecture {archs or raw.get('model_type')!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def need(key: str) -> Any:
            if key not in raw or raw[key] is None:
                raise ModelConfigError(f"config.json lacks {key!r}")
            return raw[key]

        def positive(key: str, value: Any) -> int:
            if not isinstance(value, int) or value <= 0:
                raise ModelConfigError(f"config.json: {key} must be a positive integer, got {value!r}")
            return value

        hidden = positive("hidden_size", need("hidden_size"))
        num_heads = positive("num_attention_heads", need("num_attention_heads"))
        num_kv_heads = positive("num_key_value_heads", raw.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ModelConfigError(f"num_attention_heads ({num_heads}) is not a multiple of "
                                   f"num_key_value_heads ({num_kv_heads})")
        head_dim = raw.get("head_dim") or hidden // num_heads
        positive("head_dim", head_dim)
        if head_dim % 2:
            raise ModelConfigError(f"head_dim must be even for RoPE, got {head_dim}")

        sliding_window = raw.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
            sliding_window = None  # Qwen2 configs carry a window they do not use unless asked
        if arch in ("Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM") \
                and not raw.get("use_sliding_window", False):
            sliding_window = None
        moe = _moe_config(arch, raw, positive)

        eos = raw.get("eos_token_id")
        eos_ids = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
        return cls(
            path=path,
            architecture=arch,
            vocab_size=positive("vocab_size", need("vocab_size")),
            hidden_size=hidden,
            # Mixtral's intermediate_size is its experts'; a model whose layers are all sparse needs no dense size
            intermediate_size=positive("intermediate_size", raw.get("intermediate_size") or (
                moe.intermediate_size if moe is not None else need("intermediate_size"))),
            num_layers=positive("num_hidden_layers", need("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=positive("max_position_embeddings",
                                             raw.get("max_position_embeddings", 4096)),
            rope=_rope_config(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always biases q/k/v (never o), Qwen2-MoE as its `qkv_bias` says; the Llama family (and
            # Qwen3-MoE) follows `attention_bias` for all four, Mixtral has none
            qkv_bias=arch == "Qwen2ForCausalLM" or (arch == "Qwen2MoeForCausalLM" and bool(raw.get("qkv_bias", True)))
            or (arch not in ("Qwen2MoeForCausalLM", "MixtralForCausalLM") and bool(raw.get("attention_bias", False))),
            o_proj_bias=arch not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")
            and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            sliding_window=sliding_window,
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            config_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            moe=moe,
        )


def _moe_config(arch: str, raw: dict[str, Any], positive: Callable[[str, Any], int]) -> MoeConfig | None:
    if arch not in MOE_ARCHITECTURES:
        return None
    # transformers writes Qwen3-MoE's expert count as `num_local_experts` (its attribute map), Qwen's own
    # checkpoints as `num_experts`; Mixtral's is `num_local_experts`
    num_experts = positive("num_experts", raw.get("num_experts") or raw.get("num_local_experts"))
    top_k = positive("num_experts_per_tok", raw.get("num_experts_per_tok"))
    if top_k > num_experts:
        raise ModelConfigError(f"config.json: num_experts_per_tok ({top_k}) exceeds num_experts ({num_experts})")
    if arch == "MixtralForCausalLM":
        return MoeConfig(num_experts=num_experts, num_experts_per_tok=top_k,
                         intermediate_size=positive("intermediate_size", raw.get("intermediate_size")),
                         norm_topk_prob=True)
    mlp_only = raw.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) for i in mlp_only):
        raise ModelConfigError(f"config.json: mlp_only_layers must be a list of layer indices, got {mlp_only!r}")
    shared = (raw.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    return MoeConfig(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        intermediate_size=positive("moe_intermediate_size", raw.get("moe_intermediate_size")),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=positive("shared_expert_intermediate_size", shared) if shared else 0,
        decoder_sparse_step=positive("decoder_sparse_step", raw.get("decoder_sparse_step") or 1),
        mlp_only_layers=frozenset(mlp_only),
    )


def _rope_config(raw: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta inside); older configs have rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise ModelConfigError(f"unsupported rope type {rope_type!r}; supported: default, linear, llama3")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


@dataclass
class EngineConfig:
    """The user's choices. Defaults mirror vLLM's where they make sense on a CPU."""

    model: str
    dtype: str = "auto"
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None  # budget when num_kv_blocks is None
    # vLLM's meaning: the fraction of the GPU's total memory this engine may use (weights, activations, KV
    # cache), so engines can share a GPU (engine/device.py). Ignored on CPU.
    gpu_memory_utilization: float = 0.9
    load_format: str = "auto"
    seed: int = 0
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES
    device: str = "auto"
    hash_seed: str = "tandem"
    skip_tokenizer_init: bool = False
    enforce_eager: bool = False  # no CUDA graphs for decode
    max_graph_batch_size: int = 256  # larger decode batches run eagerly
    # Hopper GPUs: the MLP's gate_up GEMM with SiLU-and-mul in its epilogue, one kernel, at decode batches of
    # 64-512 (engine/kernels/hopper_mlp.py, built with nvcc at start-up; without nvcc, cuBLAS + SiLU-and-mul)
    fused_gate_up_silu: bool = True
    # Schedule and launch step N+1 before reading step N's sampled tokens, so the host's work (scheduling,
    # input packing, output bookkeeping) overlaps the device's; outputs then come one step() later, and an
    # EOS or stop token ends its request one step late (the extra token is discarded). None: on for CUDA,
    # off on CPU, where nothing runs concurrently with the host.
    async_scheduling: bool | None = None
    # vLLM's: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N, "prompt_lookup_min": M}, as
    # a dict, a JSON string or a SpeculativeConfig; held as a SpeculativeConfig (engine/spec_decode/). None: off.
    # Speculative steps run synchronously: it turns async_scheduling off.
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    # vLLM's name: the ranks a node's model is split over (engine/parallel/executor.py); each holds its heads'
    # slice of the weights and of the KV pool. Rank 0 is this process; the others are worker processes.
    tensor_parallel_size: int = 1
    # vLLM's knob: a mixture-of-experts model's experts are split across the tensor-parallel ranks (each rank
    # holds whole experts, tokens travel to them) instead of every expert's intermediate dim being split
    enable_expert_parallel: bool = False
    # vLLM's name: how expert parallelism dispatches tokens and combines the experts' outputs (engine/layers/moe.py)
    all2all_backend: str = "allgather_reducescatter"
    # vLLM's --kv-offloading-size, in bytes here: a host-memory tier below the KV pool that the pool's evicted
    # prefix blocks spill to and prefix hits load back from (engine/cache/host_tier.py). 0: none.
    kv_offloading_bytes: int = 0

    @property
    def fp8_kv_cache(self) -> bool:
        return self.kv_cache_dtype in FP8_KV_CACHE_DTYPES

    def __post_init__(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        check(self.load_format in LOAD_FORMATS, f"load_format must be one of {LOAD_FORMATS}, "
                                                f"got {self.load_format!r}")
        check(self.attention_backend in ATTENTION_BACKENDS,
              f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        check(self.all2all_backend in ALL2ALL_BACKENDS,
              f"all2all_backend must be one of {ALL2ALL_BACKENDS}, got {self.all2all_backend!r}")
        check(self.kv_cache_dtype in KV_CACHE_DTYPES, kv_cache_dtype_error(self.kv_cache_dtype))
        check(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
              f"block_size must be a power of two, got {self.block_size}")
        check(self.max_num_batched_tokens > 0, "max_num_batched_tokens must be positive")
        check(self.max_num_seqs > 0, "max_num_seqs must be positive")
        check(self.num_kv_blocks is None or self.num_kv_blocks > 0, "num_kv_blocks must be positive")
        check(self.max_model_len is None or self.max_model_len > 0, "max_model_len must be positive")
        check(isinstance(self.kv_offloading_bytes, int) and self.kv_offloading_bytes >= 0,
              f"kv_offloading_bytes must be a non-negative int, got {self.kv_offloading_bytes!r}")
        # each rank would need its own copies of its slice of every block (engine/kv_tiers.py)
        check(not self.kv_offloading_bytes or self.tensor_parallel_size == 1,
              "a host KV tier (kv_offloading_size) runs with tensor_parallel_size 1 for now")
        check(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
              "kv_cache_memory_bytes must be positive")
        check(isinstance(self.gpu_memory_utilization, int | float) and not isinstance(self.gpu_memory_utilization, bool)
              and 0.0 < self.gpu_memory_utilization <= 1.0,
              f"gpu_memory_utilization must be a fraction in (0, 1], got {self.gpu_memory_utilization!r}")
        check(isinstance(self.tensor_parallel_size, int) and not isinstance(self.tensor_parallel_size, bool)
              and self.tensor_parallel_size >= 1,
              f"tensor_parallel_size must be a positive int, got {self.tensor_parallel_size!r}")
        check(isinstance(self.device, str) and DEVICE_FORM.match(self.device) is not None,
              f"device must be {DEVICE_CHOICES}, got {self.device!r}")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)


def kv_cache_dtype_error(value: object) -> str:
    """The message for a kv_cache_dtype this engine does not take (vLLM's other values are named as such)."""
    if value in ("fp8_e5m2", "fp8_inc", "fp8_ds_mla", "bfloat16"):
        return (f"kv_cache_dtype {value!r} is not supported here; supported: {', '.join(KV_CACHE_DTYPES)} "
                f"(fp8 is e4m3)")
    return f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {value!r}"
