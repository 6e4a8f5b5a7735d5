"""Package rules: kvtransfer knows block ids and memory regions, not models (docs/architecture.md#layering), and
loads a transfer library only when its backend is chosen."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvtransfer import InvalidRequestError, KVLayout, KVRegion, MemoryKind, make_connector

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {"engine", "protos", "prefill_node", "decode_node", "proxy", "cluster", "google", "grpc"}


def test_kvtransfer_imports_no_engine_protos_or_node_package() -> None:
    offenders = {}
    for path in (ROOT / "kvtransfer").rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        if names & FORBIDDEN:
            offenders[path.name] = names & FORBIDDEN
    assert offenders == {}


def test_importing_kvtransfer_loads_no_transfer_library_and_no_torch() -> None:
    code = ("import sys, kvtransfer, kvtransfer.checksum, kvtransfer.handshake, kvtransfer.descriptors, "
            "kvtransfer.ipc, kvtransfer.same_host; "  # ipc imports torch only for GPU pools; auto, backends when made
            "loaded = {'torch', 'nixl', 'mooncake'} & {m.split('.')[0] for m in sys.modules}; "
            "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_make_connector_refuses_an_unknown_backend() -> None:
    layout = KVLayout("m", "float32", 1, 1, 8, 4, 1)
    with pytest.raises(InvalidRequestError, match="unknown KV transfer backend 'redis'"):
        make_connector("redis", layout=layout)


def test_region_from_a_numpy_buffer_and_its_validation() -> None:
    kv = np.zeros((8, 2, 2, 4, 2, 8), dtype=np.float32)  # [blocks, layers, 2, block_size, heads, head_dim]
    region = KVRegion.from_buffer(kv)
    assert (region.num_blocks, region.block_bytes, region.memory_kind) == (8, kv.nbytes // 8, MemoryKind.DRAM)
    assert region.block_address(3) == kv[3].ctypes.data and region.owner is kv
    with pytest.raises(InvalidRequestError, match="contiguous"):
        KVRegion.from_buffer(kv[:, 0])
    with pytest.raises(InvalidRequestError, match="equal blocks"):
        KVRegion.from_buffer(np.zeros(10, dtype=np.uint8), num_blocks=3)
    with pytest.raises(InvalidRequestError, match="num_blocks"):
        KVRegion(base_address=4096, num_blocks=0, block_bytes=16)


def test_region_from_a_torch_tensor() -> None:
    import torch

    kv = torch.zeros((4, 2, 2, 4, 2, 8), dtype=torch.bfloat16)
    region = KVRegion.from_buffer(kv)
    assert (region.base_address, region.num_blocks, region.block_bytes) == (kv.data_ptr(), 4, kv[0].nbytes)
