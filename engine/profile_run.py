"""The KV pool's tensors, and the profiling run that measures what a step needs beyond the model on a GPU.

Before the KV pool exists, the runner runs the largest step the scheduler can make (max_num_batched_tokens new
tokens, logits and sampling for max_num_seqs rows) on a temporary pool just big enough for it, and takes
torch.cuda.max_memory_allocated's increase, as vLLM's profile run does. With CUDA graphs it also runs the
largest decode batch a graph captures: the graphs keep their intermediates in a memory pool of their own, on top
of what eager steps reuse.

Not measured: the torch attention backend's decode gathers a batch's whole context ([B, context, heads, dim] per
layer), which grows with the requests' lengths, not the step's size. It is the reference backend; the GPU default
(Triton) reads the cache in place.
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.host_memory import pool_zeros
from engine.layers import kv_fp8
from engine.layers.attention import AttentionBackend, AttentionMetadata, KVCacheLayer
from engine.model.llama import LlamaForCausalLM
from engine.sampler import Sampler, SamplingRow, noise_seed
from engine.types import SamplingParams

KVCaches = list[KVCacheLayer]


def allocate_kv_pool(model_cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                     device: torch.device, fp8: bool = False) -> tuple[torch.Tensor, KVCaches]:
    """The pool and each layer's views of it.

    storage: [num_blocks, num_kv_heads, num_layers, 2 (k, v), block_size, head_dim] (see layers/attention.py), a
    layer's views [num_blocks, block_size, num_kv_heads, head_dim] through strides; or with fp8 the uint8 pool of
    engine/layers/kv_fp8.py (e4m3 values and their scales, in the same head-outermost order)."""
    c = model_cfg
    if fp8:
        pool, views = kv_fp8.allocate_fp8_pool(num_blocks, c.num_layers, block_size, c.num_kv_heads, c.head_dim,
                                               device)
        return pool, [KVCacheLayer(*layer) for layer in views]
    storage = pool_zeros((num_blocks, c.num_kv_heads, c.num_layers, 2, block_size, c.head_dim), dtype, device)
    return storage, [KVCacheLayer(storage[:, :, i, 0].transpose(1, 2), storage[:, :, i, 1].transpose(1, 2))
                     for i in range(c.num_layers)]


def kv_block_bytes(model_cfg: ModelConfig, block_size: int, dtype: torch.dtype, fp8: bool = False) -> int:
    """The bytes of one block of every layer's K and V in the pool allocate_kv_pool makes."""
    c = model_cfg
    if fp8:
        return kv_fp8.fp8_block_bytes(c.num_layers, block_size, c.num_kv_heads, c.head_dim)
    return c.num_layers * 2 * block_size * c.num_kv_heads * c.head_dim * dtype.itemsize


def profile_step_bytes(model: LlamaForCausalLM, backend: AttentionBackend, model_cfg: ModelConfig,
                       block_size: int, dtype: torch.dtype, device: torch.device, max_num_batched_tokens: int,
                       max_num_seqs: int, max_model_len: int, graph_batch: int, samples_per_seq: int = 1,
                       fp8_kv: bool = False) -> int:
    """The activation reserve: the peak a step allocates beyond the model (and the decode graphs' on top when
    `graph_batch` > 0). Leaves torch's cache empty, so the device's free memory is what the process does not
    hold. `samples_per_seq`: rows of logits a sequence may sample in one step (1 + its drafts with speculative
    decoding)."""
    num_tokens = min(max_num_batched_tokens, max_num_seqs * max_model_len)
    # one sequence per max_model_len tokens: a single long prompt is the attention kernels' worst case
    seq_lens = [max_model_len] * (num_tokens // max_model_len) + [num_tokens % max_model_len]
    peak = _measure(model, backend, model_cfg, block_size, dtype, device, [n for n in seq_lens if n],
                    num_sampled=min(max_num_seqs * samples_per_seq, num_tokens), fp8_kv=fp8_kv)
    if graph_batch > 0:
        peak += _measure(model, backend, model_cfg, block_size, dtype, device, [1] * graph_batch,
                         num_sampled=graph_batch, fp8_kv=fp8_kv)
    return peak


def _measure(model: LlamaForCausalLM, backend: AttentionBackend, model_cfg: ModelConfig, block_size: int,
             dtype: torch.dtype, device: torch.device, seq_lens: list[int], num_sampled: int,
             fp8_kv: bool = False) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run_dummy_step(model, backend, model_cfg, block_size, dtype, device, seq_lens, num_sampled, fp8_kv=fp8_kv)
    torch.cuda.synchronize(device)
    # the temporary pool was allocated within the measured span: the real pool has a budget of its own
    num_blocks = sum(-(-n // block_size) for n in seq_lens)
    pool_bytes = num_blocks * kv_block_bytes(model_cfg, block_size, dtype, fp8_kv)
    peak = torch.cuda.max_memory_allocated(device) - before - pool_bytes
    torch.cuda.empty_cache()
    return max(0, peak)


@torch.inference_mode()
def run_dummy_step(model: LlamaForCausalLM, backend: AttentionBackend, model_cfg: ModelConfig, block_size: int,
                   dtype: torch.dtype, device: torch.device, seq_lens: list[int], num_sampled: int,
                   fp8_kv: bool = False) -> list[int]:
    """One step of new sequences of `seq_lens` tokens (token 0) on a temporary pool, with logits and random
    sampling (top-k and top-p: the sampler's sort is its largest temporary) for its first `num_sampled` rows.
    Returns the sampled token ids."""
    seq_lens = sorted(seq_lens)  # one-token sequences first: the backends take them as the batch's decodes
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    _, kv_caches = allocate_kv_pool(model_cfg, sum(blocks_per_seq), block_size, dtype, device, fp8=fp8_kv)
    input_ids, meta = _dummy_step(seq_lens, blocks_per_seq, block_size, device, model_cfg.sliding_window)
    positions = torch.cat([torch.arange(n, device=device) for n in seq_lens])
    hidden = model(input_ids, positions, kv_caches, meta, backend)
    logits = model.compute_logits(hidden[torch.arange(num_sampled, device=device)])
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=min(50, model_cfg.vocab_size), max_tokens=1)
    rows = [SamplingRow(params=params, seed=noise_seed(0, i), prompt_token_ids=[], output_token_ids=[])
            for i in range(num_sampled)]
    return [token.token_id for token in Sampler()(logits, rows)]


def _dummy_step(seq_lens: list[int], blocks_per_seq: list[int], block_size: int, device: torch.device,
                sliding_window: int | None) -> tuple[torch.Tensor, AttentionMetadata]:
    """Token 0 everywhere; sequence i owns a run of consecutive blocks of the temporary pool."""
    starts: list[int] = [0]
    tables: list[list[int]] = []
    slots: list[int] = []
    first_block = 0
    for n, num_blocks in zip(seq_lens, blocks_per_seq, strict=True):
        starts.append(starts[-1] + n)
        tables.append(list(range(first_block, first_block + num_blocks)))
        slots.extend(range(first_block * block_size, first_block * block_size + n))
        first_block += num_blocks
    width = max(blocks_per_seq)
    padded = [table + [0] * (width - len(table)) for table in tables]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        num_decodes=sum(1 for n in seq_lens if n == 1),
        query_start_loc_host=starts, seq_lens_host=list(seq_lens), sliding_window=sliding_window)
    return torch.zeros(starts[-1], dtype=torch.int64, device=device), meta
