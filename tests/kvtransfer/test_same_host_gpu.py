"""The auto backend between GPU pools: CUDA IPC for a peer on this host, NIXL for a peer on another host (a real
ipc payload naming another boot) or with a pool in host memory, and a plain nixl node reading an auto node's GPU
pool. Needs a CUDA device.

    python -m pytest -q tests/kvtransfer/test_same_host_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from tests.kvtransfer.peer_process import PeerProcess, assert_read_lands
from tests.kvtransfer.test_same_host import FAST_S, on_another_host

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_gpu_pools_use_cuda_ipc_on_this_host_and_nixl_for_another_host_or_memory_kind() -> None:
    prefill = PeerProcess("auto", seed=7, device="cuda", wait=False, read_timeout_s=FAST_S)
    decode = PeerProcess("auto", seed=8, device="cuda", wait=False, read_timeout_s=FAST_S)
    host_decode = PeerProcess("auto", seed=9, wait=False, read_timeout_s=FAST_S)  # its pool in host memory
    nixl_decode = PeerProcess("nixl", seed=10, device="cuda", wait=False, read_timeout_s=FAST_S)
    started = [prefill, decode, host_decode, nixl_decode]
    try:
        for peer in started:
            peer.wait_ready(120)
        p_id = decode.call("add_peer", prefill.metadata, timeout=60)
        assert decode.call("chosen_backend", p_id) == "ipc"  # CUDA IPC
        assert_read_lands(decode, p_id, prefill, [1, 2, 3, 60], [4, 5, 6, 0])
        assert decode.call("add_peer", on_another_host(prefill.metadata, boot_id="another-boot"), timeout=60) == p_id
        assert decode.call("chosen_backend", p_id) == "nixl"
        assert_read_lands(decode, p_id, prefill, [7, 8, 9, 61], [10, 11, 12, 1])
        # ipc copies GPU to GPU or host to host only: a host pool reads the GPU pool over NIXL
        assert host_decode.call("add_peer", prefill.metadata, timeout=60) == p_id
        assert host_decode.call("chosen_backend", p_id) == "nixl"
        assert_read_lands(host_decode, p_id, prefill, [13, 14, 62], [20, 21, 2])
        assert nixl_decode.call("add_peer", prefill.metadata, timeout=60) == p_id
        assert_read_lands(nixl_decode, p_id, prefill, [15, 16, 17, 63], [30, 31, 32, 3])
    finally:
        for peer in started:
            peer.stop()
