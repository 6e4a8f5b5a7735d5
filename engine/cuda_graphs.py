"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed with inputs copied into static
buffers. A decode step of a small batch is dominated by kernel launches; a graph replays them all at once.

Rows past the real batch are padding: token 0 at position 0, seq_len 0 (decode attention writes a zero
row) and a slot in the padding block, a block past the pool that no request ever owns. Every attention
backend stores there without a branch (a slot of -1 would be skipped by the Triton store but would wrap
around to the pool's last block in torch's indexing).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from engine.layers.attention import AttentionBackend, AttentionMetadata, KVCacheLayer
from engine.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch (max_batch itself always included)."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(buckets))


class DecodeGraphs:
    @torch.inference_mode()  # as the steps run: no autograd state recorded into the static buffers or the pool
    def __init__(self, model: LlamaForCausalLM, kv_caches: Sequence[KVCacheLayer],
                 backend: AttentionBackend, max_batch: int, max_blocks_per_seq: int,
                 sliding_window: int | None, padding_slot: int) -> None:
        device = model.lm_head.weight.device
        dtype = model.lm_head.weight.dtype
        self.max_batch = max_batch
        self.max_blocks_per_seq = max_blocks_per_seq
        self.padding_slot = padding_slot
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch,), padding_slot, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(max_batch, model.config.hidden_size, dtype=dtype, device=device)
        # in the model's dtype, as compute_logits gives them on one rank (graphs run on one rank only)
        self.logits = torch.zeros(max_batch, model.config.vocab_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        # largest first, so the smaller graphs fit in the memory pool the largest one made
        for batch in reversed(batch_buckets(max_batch)):
            meta = self._metadata(batch, sliding_window)
            args = (self.input_ids[:batch], self.positions[:batch], kv_caches, meta, backend)
            self.hidden[:batch] = model(*args)  # warm-up: compiles kernels outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.hidden[:batch] = model(*args)
                self.logits[:batch] = model.compute_logits(self.hidden[:batch])
            pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize(device)
        logger.info("captured decode CUDA graphs for batch sizes %s", sorted(self.graphs))

    def _metadata(self, batch: int, sliding_window: int | None) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch], query_start_loc=self.query_start_loc[:batch + 1],
            seq_lens=self.seq_lens[:batch], block_tables=self.block_tables[:batch], num_decodes=batch,
            query_start_loc_host=list(range(batch + 1)), seq_lens_host=[0] * batch,
            sliding_window=sliding_window)

    def bucket(self, batch: int) -> int | None:
        return next((b for b in sorted(self.graphs) if b >= batch), None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replays the graph of the smallest bucket that holds the batch; returns the logits [B, vocab]."""
        batch = input_ids.shape[0]
        bucket = self.bucket(batch)
        assert bucket is not None and meta.block_tables.shape[1] <= self.max_blocks_per_seq, "batch too big"
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.slot_mapping[:batch].copy_(meta.slot_mapping)
        self.slot_mapping[batch:bucket].fill_(self.padding_slot)
        self.seq_lens[:batch].copy_(meta.seq_lens)
        self.seq_lens[batch:bucket].zero_()
        self.block_tables[:bucket].zero_()
        self.block_tables[:batch, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.graphs[bucket].replay()
        return self.logits[:batch]
