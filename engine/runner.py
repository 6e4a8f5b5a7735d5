"""The model runner: owns the model and the paged KV cache of one rank, turns a scheduled step into tensors,
runs the forward pass and samples.

`execute` only launches: nothing in it waits for the device (host values go over in one non-blocking copy
from pinned memory, the samples come back in engine/sampled_step.py). A request's input token that the
last launched step sampled and the host has not read yet is taken from that step's device tensor of
sampled ids.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from engine.config import EngineConfig, ModelConfig
from engine.cuda_graphs import DecodeGraphs
from engine.device import GpuMemoryError, check_free_memory, gib, plan_gpu_memory, resolve_device
from engine.layers import kv_fp8
from engine.layers.attention import AttentionBackend, AttentionMetadata, TorchAttention
from engine.model.loader import build_model
from engine.profile_run import allocate_kv_pool, kv_block_bytes, profile_step_bytes
from engine.sampled_step import SampledStep
from engine.sampler import Sampler, SamplingRow, noise_seed, to_device
from engine.scheduler import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CPU_KV_BUDGET_BYTES = 2 << 30


def resolve_dtype(name: str, model: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    dtype = _DTYPES.get(str(model.config_dtype).removeprefix("torch."), torch.float32)
    if device.type == "cpu" and dtype == torch.float16:
        return torch.bfloat16  # CPU half matmuls are slow and overflow-prone; bf16 keeps the range
    return dtype


def resolve_attention_backend(name: str, device: torch.device) -> str:
    return ("triton" if device.type == "cuda" else "torch") if name == "auto" else name


def make_attention_backend(name: str) -> AttentionBackend:
    if name == "triton":
        from engine.kernels.backend import TritonAttention  # needs triton: only when chosen

        return TritonAttention()
    return TorchAttention()


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, max_model_len: int) -> None:
        self.device = resolve_device(cfg.device)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # Triton launches its kernels on the current device
        self.dtype = resolve_dtype(cfg.dtype, model_cfg, self.device)
        self.model_cfg = model_cfg
        self.block_size = cfg.block_size
        self.fp8_kv = cfg.fp8_kv_cache
        self.sliding_window = model_cfg.sliding_window
        backend_name = resolve_attention_backend(cfg.attention_backend, self.device)
        # the Triton layer kernels come with the Triton attention backend on a GPU; on CPU they would only
        # run interpreted, which the kernel tests do on their own
        fused = backend_name == "triton" and self.device.type == "cuda"
        self.model = build_model(model_cfg, self.dtype, self.device, max_model_len, cfg.load_format, cfg.seed,
                                 fused_kernels=fused)
        self.backend = make_attention_backend(backend_name)
        use_graphs = self.device.type == "cuda" and not cfg.enforce_eager
        graph_batch = min(cfg.max_graph_batch_size, cfg.max_num_seqs) if use_graphs else 0
        self.num_blocks = cfg.num_kv_blocks or self._default_num_blocks(cfg, max_model_len, graph_batch)
        # With CUDA graphs, one more block past the pool: the padding rows of a graph store their K/V there.
        # The block pool never hands it out, and it is not part of `kv_cache` (what transfers register).
        num_allocated = self.num_blocks + 1 if use_graphs else self.num_blocks
        if self.device.type == "cuda" and (cfg.num_kv_blocks or cfg.kv_cache_memory_bytes):
            # a size the user fixed: not planned against the GPU's memory, but never allocated into an OOM
            check_free_memory(torch.cuda.mem_get_info(self.device)[0], num_allocated * self.block_bytes,
                              f"a KV cache of {self.num_blocks} blocks")
        storage, self.kv_caches = allocate_kv_pool(model_cfg, num_allocated, self.block_size, self.dtype,
                                                   self.device, fp8=self.fp8_kv)
        self.kv_cache = storage[:self.num_blocks]
        self.sampler = Sampler()
        self.last_sampled: SampledStep | None = None  # the last launched step's samples: next inputs
        self.graphs: DecodeGraphs | None = None
        if use_graphs:
            self.graphs = DecodeGraphs(self.model, self.kv_caches, self.backend, graph_batch,
                                       -(-max_model_len // self.block_size), self.sliding_window,
                                       padding_slot=self.num_blocks * self.block_size)
        logger.info("model %s on %s in %s, %d KV blocks of %d tokens (%s)", model_cfg.architecture, self.device,
                    self.dtype, self.num_blocks, self.block_size, self.kv_cache_dtype)

    @property
    def block_bytes(self) -> int:
        return kv_block_bytes(self.model_cfg, self.block_size, self.dtype, self.fp8_kv)

    @property
    def kv_cache_dtype(self) -> str:
        """What a KV block holds, as the transfer handshake names it: the model dtype, or the FP8 format."""
        return kv_fp8.FP8_LAYOUT_NAME if self.fp8_kv else str(self.dtype).removeprefix("torch.")

    def _default_num_blocks(self, cfg: EngineConfig, max_model_len: int, graph_batch: int) -> int:
        if cfg.kv_cache_memory_bytes is not None:
            budget = cfg.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._gpu_kv_budget(cfg, max_model_len, graph_batch)
        else:
            budget = _CPU_KV_BUDGET_BYTES  # gpu_memory_utilization is a GPU's: a host has no such share
        # never more than every seat filled to the context limit
        wanted = cfg.max_num_seqs * -(-max_model_len // cfg.block_size)
        return max(1, min(wanted, budget // self.block_bytes))

    def _gpu_kv_budget(self, cfg: EngineConfig, max_model_len: int, graph_batch: int) -> int:
        """gpu_memory_utilization's share of the GPU, less the model and the profiled activations
        (engine/device.py)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the loader's temporaries are not the model's
        model_bytes = torch.cuda.memory_reserved(self.device)
        activation_bytes = profile_step_bytes(self.model, self.backend, self.model_cfg, self.block_size, self.dtype,
                                              self.device, cfg.max_num_batched_tokens, cfg.max_num_seqs,
                                              max_model_len, graph_batch, fp8_kv=self.fp8_kv)
        free, total = torch.cuda.mem_get_info(self.device)
        plan = plan_gpu_memory(total, cfg.gpu_memory_utilization, model_bytes, activation_bytes, free)
        if plan.kv_cache < self.block_bytes:
            raise GpuMemoryError(f"gpu_memory_utilization={cfg.gpu_memory_utilization:g} leaves {gib(plan.kv_cache)}"
                                 f" for the KV cache, less than one block ({gib(self.block_bytes)}): raise it")
        logger.info("GPU memory: %s of %s (gpu_memory_utilization=%g): model %s, activations %s, KV cache %s",
                    gib(plan.allowed), gib(total), cfg.gpu_memory_utilization, gib(model_bytes),
                    gib(activation_bytes), gib(plan.kv_cache))
        return plan.kv_cache

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> SampledStep:
        """Launches one step; returns the samples of each request whose step reached its last token."""
        # decodes (one new token) first, so the attention backend can batch them
        items = sorted(out.scheduled, key=lambda s: s.num_new_tokens != 1)
        input_ids, positions, meta, sample_rows = self._prepare(items)
        sampling = [item for item in items if item.samples]
        if self.graphs is not None and meta.num_decodes == len(items) and self.graphs.bucket(len(items)):
            logits = self.graphs.run(input_ids, positions, meta)  # every decode row samples
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
            if not sampling:
                self.last_sampled = SampledStep.empty(self.device)
                return self.last_sampled
            if sample_rows.shape[0] < hidden.shape[0]:  # only rows that reach the end of their tokens need logits
                hidden = hidden[sample_rows]
            logits = self.model.compute_logits(hidden)
        rows = [self._sampling_row(item) for item in sampling]
        samples = self.sampler.sample(logits, rows)
        self.last_sampled = SampledStep([item.request.request_id for item in sampling], samples)
        return self.last_sampled

    def _prepare(self, items: Sequence[ScheduledRequest]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        # input rows whose token the last step sampled, and that token's row in last_sampled
        pending_rows: list[int] = []
        pending_sources: list[int] = []
        for item in items:
            req = item.request
            begin, end = item.start, item.start + item.num_new_tokens
            input_ids.extend(req.token_ids[begin:end])
            if len(req.token_ids) < end:  # the last input is pending: it lives on the device
                last = self.last_sampled
                assert end == len(req.token_ids) + 1 and last is not None and req.request_id in last.row_of, (
                    f"request {req.request_id}: input {end - 1} is neither on the host nor the last step's sample")
                pending_rows.append(len(input_ids))
                pending_sources.append(last.row_of[req.request_id])
                input_ids.append(0)  # replaced on the device
            positions.extend(range(begin, end))
            table = req.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(begin, end))
            starts.append(len(input_ids))
            seq_lens.append(end)
            if item.samples:
                sample_rows.append(len(input_ids) - 1)
        max_blocks = max(len(item.request.block_ids) for item in items)
        tables = [block for item in items
                  for block in item.request.block_ids + [0] * (max_blocks - len(item.request.block_ids))]
        # one host-to-device copy for all of the step's integers, instead of one per tensor
        sizes = [len(input_ids), len(positions), len(slots), len(starts), len(seq_lens), len(tables),
                 len(sample_rows), len(pending_rows), len(pending_sources)]
        packed = to_device(input_ids + positions + slots + starts + seq_lens + tables + sample_rows + pending_rows
                           + pending_sources, torch.int64, self.device)
        ids_d, positions_d, slots_d, starts_d, seq_lens_d, tables_d, sample_rows_d, pending_rows_d, sources_d = (
            packed.split(sizes))
        if pending_rows:
            assert self.last_sampled is not None
            ids_d.index_copy_(0, pending_rows_d, self.last_sampled.device_token_ids.index_select(0, sources_d))
        meta = AttentionMetadata(
            slot_mapping=slots_d,
            query_start_loc=starts_d.to(torch.int32),
            seq_lens=seq_lens_d.to(torch.int32),
            block_tables=tables_d.to(torch.int32).view(len(items), max_blocks),
            num_decodes=sum(1 for item in items if item.num_new_tokens == 1),
            query_start_loc_host=starts,
            seq_lens_host=seq_lens,
            sliding_window=self.sliding_window,
        )
        return ids_d, positions_d, meta, sample_rows_d

    @staticmethod
    def _sampling_row(item: ScheduledRequest) -> SamplingRow:
        req = item.request
        # the tokens sampled before this step, pending ones included: the index of this step's token
        output_index = req.num_output_tokens + item.num_pending_before
        seed = None if req.params.greedy else noise_seed(req.seed, output_index)
        return SamplingRow(params=req.params, seed=seed, prompt_token_ids=req.prompt_token_ids,
                           output_token_ids=req.output_token_ids, eos_token_ids=req.eos_token_ids,
                           num_pending_output_tokens=item.num_pending_before)
