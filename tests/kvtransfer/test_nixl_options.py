"""NIXL's UCX settings (kvtransfer/ucx_config.py, `NixlConnector(ucx_config=...)`) and its descriptor merging,
against a real NIXL 1.5.1 agent and the UCX it bundles.

NIXL and UCX run in a spawned process started with the contract suite's loopback launch environment, so UCX reads
its configuration where the test controls it (and a UCX crash cannot take pytest down).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtransfer import BackendError, InvalidRequestError, KVLayout, MemoryKind
from kvtransfer.ucx_config import GPU_DEFAULTS, UcxConfig, default_ucx_config, nixl_backend_params, parse_ucx_config
from tests.kvtransfer.peer_process import launch_environment

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = KVLayout(model="tiny-test", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4,
                  tp_size=1)
NUM_BLOCKS, BLOCK_BYTES = 64, 4096


# ---- what runs in the NIXL process -----------------------------------------------------------------------------

def _launched() -> None:
    os.environ.update(launch_environment(5.0))


def _registered_backend_params(ucx_config: str | None) -> dict[str, str] | None:
    """Registers a host-memory pool with a connector made with these settings; the UCX backend's parameters."""
    from kvtransfer import KVRegion
    from kvtransfer.nixl import NixlConnector

    kv = np.ones((NUM_BLOCKS, BLOCK_BYTES), dtype=np.uint8)
    with NixlConnector(layout=LAYOUT, ucx_devices="lo", ucx_config=ucx_config) as connector:
        connector.register(KVRegion.from_buffer(kv))
        return connector.backend_params


def _read_lands(ucx_config: str, remote_ids: list[int], local_ids: list[int]) -> bool:
    """P and D connectors with these settings; D reads P's blocks; True when D's pool then holds exactly P's
    blocks at those ids and its own bytes everywhere else."""
    from kvtransfer import KVRegion, TransferStatus
    from kvtransfer.nixl import NixlConnector

    source = np.random.default_rng(1).integers(0, 256, (NUM_BLOCKS, BLOCK_BYTES), dtype=np.uint8)
    destination = np.random.default_rng(2).integers(0, 256, (NUM_BLOCKS, BLOCK_BYTES), dtype=np.uint8)
    expected = destination.copy()
    expected[local_ids] = source[remote_ids]
    with NixlConnector(layout=LAYOUT, ucx_devices="lo", ucx_config=ucx_config) as p, \
            NixlConnector(layout=LAYOUT, ucx_devices="lo", ucx_config=ucx_config) as d:
        p.register(KVRegion.from_buffer(source))
        d.register(KVRegion.from_buffer(destination))
        handle = d.read(d.add_peer(p.metadata), remote_ids, local_ids)
        while (status := d.poll(handle)) is TransferStatus.PENDING:
            p.progress()  # the memory owner makes progress, as its node loop would
            d.progress()
        return status is TransferStatus.DONE and bool((destination == expected).all())


def _ucx_refuses(items: tuple[tuple[str, str], ...]) -> list[str]:
    from nixl._api import nixl_agent, nixl_agent_config

    from kvtransfer.ucx_config import loaded_ucp_library, refused_items

    agent = nixl_agent("ucx-check", nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                                     backends=[]))
    agent.get_plugin_params("UCX")
    library = loaded_ucp_library()
    assert library is not None, "NIXL's UCX plugin did not load a libucp"
    return refused_items(UcxConfig(items), library)


def _nixl_descriptor_counts(cases: list[tuple[list[int], list[int]]]) -> list[tuple[int, bool]]:
    """For each (remote ids, local ids): a raw NIXL READ built as NixlConnector builds it (per-block prepared lists,
    BlockRuns.block_indices in run order); (descriptors NIXL's telemetry counted, whether the bytes landed)."""
    from nixl._api import nixl_agent, nixl_agent_config

    from kvtransfer.descriptors import coalesce_runs
    from kvtransfer.nixl import block_descriptors

    def agent(name: str) -> Any:
        made = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                                  capture_telemetry=True, backends=[]))
        made.create_backend("UCX", {"ucx_devices": "lo"})
        return made

    owner, reader = agent("owner"), agent("reader")
    source = np.random.default_rng(1).integers(0, 256, (NUM_BLOCKS, BLOCK_BYTES), dtype=np.uint8)
    destination = np.zeros_like(source)
    owner.register_memory([(source.ctypes.data, source.nbytes, 0, "")], "DRAM")
    reader.register_memory([(destination.ctypes.data, destination.nbytes, 0, "")], "DRAM")
    reader.add_remote_agent(owner.get_agent_metadata())
    local = reader.prep_xfer_dlist("NIXL_INIT_AGENT", block_descriptors(destination.ctypes.data, NUM_BLOCKS,
                                                                        BLOCK_BYTES, 0), "DRAM")
    remote = reader.prep_xfer_dlist("owner", block_descriptors(source.ctypes.data, NUM_BLOCKS, BLOCK_BYTES, 0),
                                    "DRAM")
    counts = []
    for remote_ids, local_ids in cases:
        destination[:] = 0
        remote_indices, local_indices = coalesce_runs(remote_ids, local_ids).block_indices()
        xfer = reader.make_prepped_xfer("READ", local, local_indices.astype(np.int32), remote,
                                        remote_indices.astype(np.int32))
        state = reader.transfer(xfer)
        while state == "PROC":
            owner.get_new_notifs()
            state = reader.check_xfer_state(xfer)
        counts.append((int(reader.get_xfer_telemetry(xfer).descCount),
                       state == "DONE" and bool((destination[local_ids] == source[remote_ids]).all())))
        xfer.release()
    return counts


@pytest.fixture(scope="module")
def nixl_process() -> Iterator[ProcessPoolExecutor]:
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn"), initializer=_launched) as pool:
        yield pool


def in_nixl_process(pool: ProcessPoolExecutor, function: Any, *args: Any) -> Any:
    return pool.submit(function, *args).result(timeout=120)


# ---- parsing and defaults (no NIXL needed) ------------------------------------------------------------------------

def test_ucx_settings_become_nixl_engine_config_without_the_ucx_prefix() -> None:
    config = parse_ucx_config(" UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y, PROTO_EMULATION_ENABLE=n ")
    assert config.items == (("CUDA_IPC_ENABLE_GET_ZCOPY", "y"), ("PROTO_EMULATION_ENABLE", "n"))
    assert config.engine_config == "CUDA_IPC_ENABLE_GET_ZCOPY=y,PROTO_EMULATION_ENABLE=n"
    assert parse_ucx_config("") == UcxConfig()
    assert nixl_backend_params(config, "lo") == {"ucx_devices": "lo", "engine_config": config.engine_config}
    assert nixl_backend_params(UcxConfig(), None) == {}


def test_a_gpu_pool_gets_get_zcopy_and_the_settings_add_to_it_or_override_it() -> None:
    assert default_ucx_config(MemoryKind.VRAM).engine_config == "CUDA_IPC_ENABLE_GET_ZCOPY=y"
    assert default_ucx_config(MemoryKind.DRAM) == UcxConfig()
    added = parse_ucx_config("PROTO_EMULATION_ENABLE=n").over(GPU_DEFAULTS)
    assert added.engine_config == "CUDA_IPC_ENABLE_GET_ZCOPY=y,PROTO_EMULATION_ENABLE=n"
    overridden = parse_ucx_config("RNDV_THRESH=inf,CUDA_IPC_ENABLE_GET_ZCOPY=auto").over(GPU_DEFAULTS)
    assert overridden.engine_config == "RNDV_THRESH=inf,CUDA_IPC_ENABLE_GET_ZCOPY=auto"


@pytest.mark.parametrize(("text", "message"), [
    ("TLS=cuda_ipc,cuda_copy", "item 'cuda_copy' is not KEY=VALUE; NIXL splits its UCX settings on commas"),
    ("GET_ZCOPY", "item 'GET_ZCOPY' is not KEY=VALUE$"),
    ("tls=tcp", "'tls' is not a UCX setting name"),
    ("TLS=", "TLS has no value"),
    ("TLS=tcp,", "an empty item"),
    ("TLS=tcp,UCX_TLS=sm", "TLS is named twice"),
])
def test_a_malformed_ucx_setting_is_refused_with_a_clear_error(text: str, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        parse_ucx_config(text)


def test_the_connector_refuses_malformed_ucx_settings_before_nixl_sees_them() -> None:
    from kvtransfer.nixl import NixlConnector

    with pytest.raises(InvalidRequestError, match="not KEY=VALUE"):
        NixlConnector(layout=LAYOUT, ucx_config="TLS=tcp,sm")


# ---- through a real NIXL agent --------------------------------------------------------------------------------------

def test_good_ucx_settings_reach_the_ucx_backend_and_reads_work(nixl_process: ProcessPoolExecutor) -> None:
    params = in_nixl_process(nixl_process, _registered_backend_params, "TLS=tcp,RNDV_THRESH=inf")
    assert params == {"ucx_devices": "lo", "engine_config": "TLS=tcp,RNDV_THRESH=inf"}
    assert in_nixl_process(nixl_process, _read_lands, "TLS=tcp", [3, 4, 5, 9, 40], [10, 11, 12, 0, 63])


def test_a_host_memory_pool_gets_no_ucx_settings_by_default(nixl_process: ProcessPoolExecutor) -> None:
    assert in_nixl_process(nixl_process, _registered_backend_params, None) == {"ucx_devices": "lo"}


def test_a_setting_ucx_does_not_know_fails_registration_instead_of_being_ignored(
        nixl_process: ProcessPoolExecutor) -> None:
    # NIXL itself would only log it at debug level and go on without it
    with pytest.raises(InvalidRequestError, match=r"refuses the UCX setting\(s\) NO_SUCH_SETTING=1.*silently"):
        in_nixl_process(nixl_process, _registered_backend_params, "RNDV_THRESH=inf,NO_SUCH_SETTING=1")
    with pytest.raises(InvalidRequestError, match="PROTO_EMULATION_ENABLE=maybe"):
        in_nixl_process(nixl_process, _registered_backend_params, "PROTO_EMULATION_ENABLE=maybe")


def test_a_setting_that_stops_ucx_from_starting_fails_backend_creation(nixl_process: ProcessPoolExecutor) -> None:
    with pytest.raises(BackendError, match="creating NIXL's UCX backend with .*TLS=no_such_transport"):
        in_nixl_process(nixl_process, _registered_backend_params, "TLS=no_such_transport")


def test_ucx_without_cuda_refuses_cuda_ipc_settings(nixl_process: ProcessPoolExecutor) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("with CUDA, UCX knows CUDA_IPC_* (tests/kvtransfer/test_nixl_gpu.py checks that)")
    refused = in_nixl_process(nixl_process, _ucx_refuses, (("RNDV_THRESH", "inf"), *GPU_DEFAULTS.items))
    assert refused == ["CUDA_IPC_ENABLE_GET_ZCOPY=y"]


def test_nixl_moves_each_run_of_block_ids_as_one_descriptor(nixl_process: ProcessPoolExecutor) -> None:
    # (remote ids, local ids, runs): runs counted by hand, where both sides advance by one block together
    cases = [
        (list(range(10, 42)), list(range(0, 32)), 1),
        ([1, 2, 3, 7, 8, 20], [30, 31, 32, 5, 6, 50], 3),
        ([5, 6, 7, 8], [9, 8, 7, 6], 4),  # local ids run backwards: nothing merges
        (list(range(0, 64, 2)), list(range(1, 64, 2)), 32),
        ([40, 41, 0, 1, 2], [60, 61, 10, 11, 12], 2),  # out of order across runs: coalescing sorts them
    ]
    counts = in_nixl_process(nixl_process, _nixl_descriptor_counts, [(r, loc) for r, loc, _ in cases])
    assert counts == [(runs, True) for _, _, runs in cases]


# ---- on a CUDA machine (the lead's H200 runs) --------------------------------------------------------------------

def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device")
def test_ucx_with_cuda_accepts_the_gpu_default(nixl_process: ProcessPoolExecutor) -> None:
    assert in_nixl_process(nixl_process, _ucx_refuses, GPU_DEFAULTS.items) == []


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device")
def test_gpu_blocks_move_between_two_processes_at_device_speed_not_over_tcp(tmp_path: Path) -> None:
    out = tmp_path / "handoff.json"
    completed = subprocess.run(
        [sys.executable, "bench/kv_handoff_gpu.py", "--device", "cuda", "--backends", "nixl,nixl-write",
         "--prompt-tokens", "1024", "--repeats", "3", "--warmup", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["skipped"] == [] and len(result["rows"]) == 6 and all(r["verified"] for r in result["rows"])
    read = next(r for r in result["rows"] if r["op"] == "READ" and r["layout"] == "contiguous")
    assert read["backend_params"]["engine_config"] == "CUDA_IPC_ENABLE_GET_ZCOPY=y"
    # UCX's TCP emulation moved 0.6 GB/s on the H200; cuda_ipc moves hundreds
    assert read["median_gb_s"] > 20, read
