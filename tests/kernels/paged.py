"""Helpers for kernel tests: a paged KV cache laid out like the engine's, scattered block tables, error checks."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedCache:
    """kv: [num_blocks, num_layers, 2, block_size, Hkv, D]; the tests use one layer's strided K/V views."""

    kv: torch.Tensor
    layer: int = 1

    @property
    def k(self) -> torch.Tensor:
        return self.kv[:, self.layer, 0]

    @property
    def v(self) -> torch.Tensor:
        return self.kv[:, self.layer, 1]

    def clone(self) -> PagedCache:
        return PagedCache(self.kv.clone(), self.layer)


def make_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
               device: str = "cpu", num_layers: int = 2) -> PagedCache:
    kv = torch.randn(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim, device=device).to(dtype)
    return PagedCache(kv)


def make_block_tables(seq_lens: list[int], block_size: int, num_blocks: int, device: str = "cpu",
                      extra_blocks: int = 1) -> torch.Tensor:
    """[B, max_blocks] int32 of distinct, shuffled (so non-contiguous) block ids, padded with 0.

    Block 0 is never handed out, so padding that is wrongly read shows up as a mismatch.
    """
    needed = [-(-n // block_size) for n in seq_lens]
    width = max(needed, default=0) + extra_blocks
    assert sum(needed) < num_blocks, "cache too small for the sequences"
    ids = (torch.randperm(num_blocks - 1) + 1).tolist()
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for b, count in enumerate(needed):
        table[b, :count] = torch.tensor(ids[:count], dtype=torch.int32)
        ids = ids[count:]
    return table.to(device)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN or inf anywhere in out fails."""
    assert torch.isfinite(out).all(), "output has NaN/inf (unwritten or broken rows)"
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


# ‖out − ref‖ / ‖ref‖ bounds. The CPU interpreter truncates float32 -> bf16 (the GPU rounds to nearest), so
# bf16 results there are a little further from the float32 reference.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def int32(values: list[int], device: str = "cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)
