"""The model runner: owns the model and the paged KV cache of one rank, turns a scheduled step into tensors,
runs the forward pass and samples.

`execute` only launches: nothing in it waits for the device (host values go over in one non-blocking copy
from pinned memory, the samples come back in engine/sampled_step.py). A request's input token that the
last launched step sampled and the host has not read yet is taken from that step's device tensor of
sampled ids.

A request with speculative drafts (engine/spec_decode/) is a multi-token query over its cached context: it
runs as a prefill chunk (never in a decode CUDA graph, which takes one query token per sequence) and samples
at each of its 1 + k positions, each row as the step that would sample that token without speculation.

Tensor parallelism (engine/parallel/executor.py): rank 0's runner starts the other ranks and sends each step's
host inputs (`StepInputs`) before it runs the step; a worker's runner runs the same forward pass from them
(`execute_inputs`) and samples nothing. CUDA graphs are off with several ranks.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch

from engine.config import EngineConfig, ModelConfig
from engine.cuda_graphs import DecodeGraphs
from engine.device import GpuMemoryError, check_free_memory, gib, plan_gpu_memory, resolve_device
from engine.kernels import hopper_mlp
from engine.layers import cpu_kernels, kv_fp8
from engine.layers.attention import AttentionBackend, AttentionMetadata, TorchAttention
from engine.layers.linear import HeadSplit
from engine.model.llama import MLP
from engine.model.loader import build_model
from engine.parallel.context import ParallelContext
from engine.parallel.executor import StepInputs, TensorParallelWorkers, resolve_call
from engine.profile_run import allocate_kv_pool, kv_block_bytes, profile_step_bytes, run_dummy_step
from engine.prompt_logprobs import PromptLogprobsPlan, compute_prompt_logprobs, take_prompt_logits
from engine.sampled_step import SampledStep
from engine.sampler import Sampler, SamplingRow, TokenBitmask, has_penalties, noise_seed, to_device
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.spec_decode.config import SpeculativeConfig

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
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, max_model_len: int,
                 parallel: ParallelContext | None = None) -> None:
        """parallel: given to a worker rank; None on rank 0, which starts the workers when the config asks for
        several ranks."""
        self.device = resolve_device(cfg.device)
        self.workers: TensorParallelWorkers | None = None
        if parallel is None:
            parallel = ParallelContext()
            if cfg.tensor_parallel_size > 1:
                # heads that do not split over the ranks are refused here, before any worker starts
                HeadSplit.of(model_cfg.num_heads, model_cfg.num_kv_heads, 0, cfg.tensor_parallel_size)
                if self.device.type == "cuda" and torch.cuda.device_count() < cfg.tensor_parallel_size:
                    raise ValueError(f"tensor_parallel_size={cfg.tensor_parallel_size} runs a rank per GPU, and this "
                                     f"process sees {torch.cuda.device_count()} GPU(s)")
                self.workers = TensorParallelWorkers(cfg, model_cfg, max_model_len, self.device.type)
                parallel = self.workers.parallel
        self.parallel = parallel
        self.rank_state: dict[str, Any] = {"runner": self}  # what call_ranks' functions get on this rank
        if parallel.is_parallel and self.device.type == "cuda":
            self.device = torch.device("cuda", parallel.tp_rank)  # one GPU per rank, the rank's own
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # Triton launches its kernels on the current device
        self.dtype = resolve_dtype(cfg.dtype, model_cfg, self.device)
        self.model_cfg = model_cfg
        self.head_split = HeadSplit.of(model_cfg.num_heads, model_cfg.num_kv_heads, parallel.tp_rank,
                                       parallel.tp_size)
        # the KV pool holds this rank's KV heads only
        self.pool_cfg = dataclasses.replace(model_cfg, num_kv_heads=self.head_split.num_kv_heads)
        self.block_size = cfg.block_size
        self.fp8_kv = cfg.fp8_kv_cache
        self.sliding_window = model_cfg.sliding_window
        backend_name = resolve_attention_backend(cfg.attention_backend, self.device)
        # the Triton layer kernels come with the Triton attention backend on a GPU; on CPU they would only
        # run interpreted, which the kernel tests do on their own
        fused = backend_name == "triton" and self.device.type == "cuda"
        self.model = build_model(model_cfg, self.dtype, self.device, max_model_len, cfg.load_format, cfg.seed,
                                 fused_kernels=fused, parallel=parallel)
        if fused and cfg.fused_gate_up_silu and hopper_mlp.device_supported(self.device):  # built before the graphs
            for module in self.model.modules():
                if isinstance(module, MLP):
                    module.gate_up_silu = True
        self.backend = make_attention_backend(backend_name)
        use_graphs = self.device.type == "cuda" and not cfg.enforce_eager and not parallel.is_parallel
        graph_batch = min(cfg.max_graph_batch_size, cfg.max_num_seqs) if use_graphs else 0
        self.num_blocks = cfg.num_kv_blocks or self._default_num_blocks(cfg, max_model_len, graph_batch)
        if parallel.is_parallel:  # every rank's pool has the same blocks: the scheduler's block ids name all
            self.num_blocks = min(parallel.gather_all_ints(self.num_blocks))
        # With CUDA graphs, one more block past the pool: the padding rows of a graph store their K/V there.
        # The block pool never hands it out, and it is not part of `kv_cache` (what transfers register).
        num_allocated = self.num_blocks + 1 if use_graphs else self.num_blocks
        if self.device.type == "cuda" and (cfg.num_kv_blocks or cfg.kv_cache_memory_bytes):
            # a size the user fixed: not planned against the GPU's memory, but never allocated into an OOM
            check_free_memory(torch.cuda.mem_get_info(self.device)[0], num_allocated * self.block_bytes,
                              f"a KV cache of {self.num_blocks} blocks")
        storage, self.kv_caches = allocate_kv_pool(self.pool_cfg, num_allocated, self.block_size, self.dtype,
                                                   self.device, fp8=self.fp8_kv)
        self.kv_cache = storage[:self.num_blocks]
        self.sampler = Sampler()
        self.last_sampled: SampledStep | None = None  # the last launched step's samples: next inputs
        self.graphs: DecodeGraphs | None = None
        if use_graphs:
            self.graphs = DecodeGraphs(self.model, self.kv_caches, self.backend, graph_batch,
                                       -(-max_model_len // self.block_size), self.sliding_window,
                                       padding_slot=self.num_blocks * self.block_size)
        if self.device.type == "cuda":
            self._warm_up(min(cfg.max_num_batched_tokens, max_model_len), cfg.max_num_batched_tokens)
        else:
            cpu_kernels.kernel()  # built (or found built) now, not inside a request's first step
        logger.info("model %s on %s in %s, %d KV blocks of %d tokens (%s)", model_cfg.architecture, self.device,
                    self.dtype, self.num_blocks, self.block_size, self.kv_cache_dtype)

    def _warm_up(self, max_prompt_tokens: int, max_step_tokens: int) -> None:
        """So that no request pays for a kernel compilation or a library's plan (over a second each, inside a
        step): one eager step of two decodes and a short prompt (the attention kernels outside the graphs, the
        sampler), and the dense attention of every prompt length one step can hold."""
        run_dummy_step(self.model, self.backend, self.pool_cfg, self.block_size, self.dtype, self.device, [1, 1, 33],
                       num_sampled=3, fp8_kv=self.fp8_kv)
        self.backend.warm_up(self.head_split.num_q_heads, self.head_split.num_kv_heads, self.model_cfg.head_dim,
                             self.dtype, self.device, max_prompt_tokens, max_step_tokens)
        torch.cuda.synchronize(self.device)

    @property
    def block_bytes(self) -> int:
        return kv_block_bytes(self.pool_cfg, self.block_size, self.dtype, self.fp8_kv)

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
        spec = SpeculativeConfig.parse(cfg.speculative_config)
        activation_bytes = profile_step_bytes(self.model, self.backend, self.pool_cfg, self.block_size, self.dtype,
                                              self.device, cfg.max_num_batched_tokens, cfg.max_num_seqs,
                                              max_model_len, graph_batch,
                                              samples_per_seq=1 + (spec.num_speculative_tokens if spec else 0),
                                              fp8_kv=self.fp8_kv)
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
        prompt_plan = PromptLogprobsPlan.of(items)
        inputs = self._host_inputs(items)
        if prompt_plan.rows:  # the workers take these rows' logits too
            inputs = dataclasses.replace(inputs, prompt_rows=prompt_plan.rows)
        if self.workers is not None:
            self.workers.send_step(inputs)
        input_ids, positions, meta, sample_rows = self._device_inputs(inputs)
        sampling = [item for item in items if item.samples]
        prompt = None
        logits: torch.Tensor | None
        # a request with drafts has more than one new token: never a decode row, so never in a graph; prompt
        # logprobs need the hidden states, which a graph keeps to itself
        if (self.graphs is not None and meta.num_decodes == len(items) and not prompt_plan.rows
                and self.graphs.bucket(len(items))):
            logits = self.graphs.run(input_ids, positions, meta)  # every decode row samples
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
            # only rows that reach the end of their tokens need logits for sampling
            logits = (None if not sampling else self.model.compute_logits(
                hidden[sample_rows] if sample_rows.shape[0] < hidden.shape[0] else hidden))
            if prompt_plan.rows:
                prompt = compute_prompt_logprobs(self.model, hidden, prompt_plan, self.model_cfg.vocab_size)
            if logits is None:
                self.last_sampled = SampledStep.empty(self.device, prompt)
                return self.last_sampled
        rows = [row for item in sampling for row in self._sampling_rows(item)]
        # the forward pass is launched: the host fills the grammars' masks while the device computes it
        samples = self.sampler.sample(logits, rows, self._token_bitmask(sampling))
        self.last_sampled = SampledStep([item.request.request_id for item in sampling
                                         for _ in range(1 + len(item.draft_token_ids))], samples, prompt)
        return self.last_sampled

    @torch.inference_mode()
    def execute_inputs(self, inputs: StepInputs) -> None:
        """A worker rank's step: rank 0's forward pass on this rank's slices (its logits gathered, not sampled)."""
        input_ids, positions, meta, sample_rows = self._device_inputs(inputs)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        if inputs.sample_rows:  # takes part in the logits' all-gather
            self.model.compute_logits(hidden[sample_rows] if sample_rows.shape[0] < hidden.shape[0] else hidden)
        if inputs.prompt_rows:
            take_prompt_logits(self.model, hidden, inputs.prompt_rows, self.model_cfg.vocab_size)

    def call_ranks(self, path: str, *args: Any) -> list[Any]:
        """Runs the function `path` ("module:function") as function(rank_state, *args) on every rank of the node,
        this one included; the results in rank order. How a node does per-rank work engine/ knows nothing of (each
        rank's KV transfer agent); must run on the thread that runs the steps."""
        if self.workers is None:
            return [resolve_call(path)(self.rank_state, *args)]
        return self.workers.call(path, self.rank_state, *args)

    def close(self) -> None:
        """Stops the worker ranks (rank 0); nothing to do on one rank."""
        if self.workers is not None:
            self.workers.close()

    def _host_inputs(self, items: Sequence[ScheduledRequest]) -> StepInputs:
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
            num_drafts = len(item.draft_token_ids)
            known_end = end - num_drafts  # then the drafts, if any
            input_ids.extend(req.token_ids[begin:known_end])
            if len(req.token_ids) < known_end:  # the last input is pending: it lives on the device
                last = self.last_sampled
                assert (known_end == len(req.token_ids) + 1 and last is not None
                        and req.request_id in last.row_of), (
                    f"request {req.request_id}: input {known_end - 1} is neither on the host nor the last step's "
                    "sample")
                pending_rows.append(len(input_ids))
                pending_sources.append(last.row_of[req.request_id])
                input_ids.append(0)  # replaced on the device
            input_ids.extend(item.draft_token_ids)
            positions.extend(range(begin, end))
            table = req.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(begin, end))
            starts.append(len(input_ids))
            seq_lens.append(end)
            if item.samples:  # the known last token's row, then each draft's
                sample_rows.extend(range(len(input_ids) - 1 - num_drafts, len(input_ids)))
        max_blocks = max(len(item.request.block_ids) for item in items)
        tables: list[int] = []
        for item in items:  # list extends: ~4x faster than a comprehension over every block, at batch 256
            tables += item.request.block_ids
            tables += [0] * (max_blocks - len(item.request.block_ids))
        return StepInputs(input_ids, positions, slots, starts, seq_lens, tables, max_blocks, sample_rows,
                          num_decodes=sum(1 for item in items if item.num_new_tokens == 1),
                          pending_rows=pending_rows, pending_sources=pending_sources)

    def _device_inputs(self, inputs: StepInputs
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        i = inputs
        # one host-to-device copy for all of the step's integers, instead of one per tensor; each part starts
        # 16-byte aligned, as kernels specialise on their pointers' alignment (a new variant is a compilation)
        parts = [i.input_ids, i.positions, i.slots, i.starts, i.seq_lens, i.block_tables, i.sample_rows,
                 i.pending_rows, i.pending_sources]
        flat: list[int] = []
        spans = []
        for part in parts:
            spans.append((len(flat), len(part)))
            flat += part
            flat += [0] * (len(part) % 2)
        packed = to_device(flat, torch.int64, self.device)
        ids_d, positions_d, slots_d, starts_d, seq_lens_d, tables_d, sample_rows_d, pending_rows_d, sources_d = (
            packed[start:start + size] for start, size in spans)
        if i.pending_rows and self.parallel.is_driver:
            assert self.last_sampled is not None
            ids_d.index_copy_(0, pending_rows_d, self.last_sampled.device_token_ids.index_select(0, sources_d))
        if i.pending_rows and self.parallel.is_parallel:
            # the pending tokens live on rank 0's device: the ranks take its input ids
            ids_d = self.parallel.broadcast(ids_d.contiguous())
        num_seqs = len(i.seq_lens)
        meta = AttentionMetadata(
            slot_mapping=slots_d,
            query_start_loc=starts_d.to(torch.int32),
            seq_lens=seq_lens_d.to(torch.int32),
            block_tables=tables_d.to(torch.int32).view(num_seqs, i.max_blocks),
            num_decodes=i.num_decodes,
            query_start_loc_host=i.starts,
            seq_lens_host=i.seq_lens,
            sliding_window=self.sliding_window,
        )
        return ids_d, positions_d, meta, sample_rows_d

    def _token_bitmask(self, sampling: Sequence[ScheduledRequest]) -> TokenBitmask | None:
        """The masks of the constrained rows (structured output), None when there are none."""
        # a request with drafts has a row per draft position; a constrained one never has drafts (scheduler.py)
        constrained = []
        row = 0
        for item in sampling:
            if item.request.grammar is not None:
                # a grammar's state is that of the tokens on the host: the engine never leaves one pending
                # (llm_engine.py)
                assert item.num_pending_before == 0 and not item.draft_token_ids, (
                    "a constrained row has a pending token or drafts")
                constrained.append((row, item.request.grammar))
            row += 1 + len(item.draft_token_ids)
        if not constrained:
            return None
        from engine.structured_output import fill_token_bitmask  # torch only: xgrammar stays in the matchers

        bitmask = fill_token_bitmask([grammar for _, grammar in constrained], self.model_cfg.vocab_size)
        return TokenBitmask([row for row, _ in constrained], bitmask)

    @staticmethod
    def _sampling_rows(item: ScheduledRequest) -> list[SamplingRow]:
        """The step's rows of a request: one, or one per position of its drafts (the sample after draft i-1 is
        taken as though drafts 0..i-1 were output: the same penalties, min_tokens and noise as the step that
        would sample it without speculation; engine/spec_decode/verify.py)."""
        req = item.request
        # the tokens sampled before this step, pending ones included: the index of this step's token
        output_index = req.num_output_tokens + item.num_pending_before
        # only penalties read the output ids: without them the row lists its drafts alone and counts the rest
        # (SamplingRow.num_unlisted_output_tokens)
        penalized = has_penalties(req.params)
        listed = req.output_token_ids if penalized else []
        unlisted = item.num_pending_before if penalized else output_index
        rows = []
        for i in range(1 + len(item.draft_token_ids)):
            seed = None if req.params.greedy else noise_seed(req.seed, output_index + i)
            rows.append(SamplingRow(params=req.params, seed=seed, prompt_token_ids=req.prompt_token_ids,
                                    output_token_ids=listed + list(item.draft_token_ids[:i]),
                                    eos_token_ids=req.eos_token_ids, num_unlisted_output_tokens=unlisted))
        return rows
