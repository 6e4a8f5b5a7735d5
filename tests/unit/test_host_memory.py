"""The CPU KV pool on transparent huge pages (engine/host_memory.py), checked in the kernel's own account of the
process's mappings (/proc/self/smaps)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig
from engine.host_memory import advise_huge_pages, huge_page_bytes, pool_zeros
from engine.profile_run import allocate_kv_pool
from tests.fixtures.tiny_models import TinyModelFactory

_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    try:
        return re.search(r"\[(\w+)\]", _THP_MODE.read_text()).group(1)  # type: ignore[union-attr]
    except (OSError, AttributeError):
        return None


needs_thp = pytest.mark.skipif(huge_page_bytes() is None or _thp_mode() in (None, "never"),
                               reason="this kernel has no transparent huge pages (or has them off)")


def _mapping_fields(address: int) -> dict[str, str]:
    """The smaps fields of the mapping that holds `address`."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            if inside:
                break
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and ":" in line:
            key, value = line.split(":", 1)
            fields[key] = value.strip()
    assert fields, f"no mapping holds {address:#x}"
    return fields


def _aligned_start(tensor: torch.Tensor) -> int:
    size = huge_page_bytes()
    assert size is not None
    return -(-tensor.untyped_storage().data_ptr() // size) * size


@needs_thp
def test_pool_zeros_are_zeros_on_host_memory_marked_for_huge_pages() -> None:
    size = huge_page_bytes()
    assert size is not None
    # three huge pages of bytes: at least one wholly inside
    tensor = pool_zeros((3 * size // 2,), torch.bfloat16, "cpu")
    assert tensor.shape == (3 * size // 2,) and tensor.dtype == torch.bfloat16
    assert not tensor.any()
    fields = _mapping_fields(_aligned_start(tensor))
    if "THPeligible" not in fields:
        pytest.skip("this kernel's smaps has no THPeligible field")
    assert fields["THPeligible"] == "1"


@needs_thp
@pytest.mark.parametrize("fp8", [False, True])
def test_the_cpu_kv_pools_are_marked_for_huge_pages(tiny_model: TinyModelFactory, fp8: bool) -> None:
    cfg = ModelConfig.from_path(tiny_model("llama"))
    storage, layers = allocate_kv_pool(cfg, num_blocks=4096, block_size=16, dtype=torch.bfloat16,
                                       device=torch.device("cpu"), fp8=fp8)
    assert storage.nbytes >= 2 * huge_page_bytes()  # type: ignore[operator]
    assert not storage.any() and len(layers) == cfg.num_layers
    fields = _mapping_fields(_aligned_start(storage))
    if "THPeligible" not in fields:
        pytest.skip("this kernel's smaps has no THPeligible field")
    assert fields["THPeligible"] == "1"


def test_memory_smaller_than_a_huge_page_is_left_alone() -> None:
    assert advise_huge_pages(torch.zeros(16)) is False
