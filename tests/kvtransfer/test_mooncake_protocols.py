"""The Mooncake connector's protocol choice: what it refuses, on any build, before a read could go wrong.

Mooncake picks its transport from the process environment and the hardware, not from the protocol argument, so
the connector checks that the engine runs what was asked (nvlink_intra) and that peers agree on the protocol.
The GPU paths themselves are in test_mooncake_gpu.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvtransfer import InvalidRequestError, KVLayout, make_connector
from kvtransfer.handshake import PeerEnvelope
from tests.kvtransfer.peer_process import PeerProcess, RemoteError

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = KVLayout("m", "float32", 1, 1, 8, 4, 1)
NVLINK_INTRA_PROBE = """
from kvtransfer import BackendError, KVLayout, make_connector
try:
    make_connector("mooncake", layout=KVLayout("m", "float32", 1, 1, 8, 4, 1), protocol="nvlink_intra")
except BackendError as e:
    print("REFUSED:", e)
else:
    print("STARTED")
"""


def run_probe(extra_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "MC_INTRANODE_NVLINK"}
    return subprocess.run([sys.executable, "-c", NVLINK_INTRA_PROBE], cwd=ROOT, env={**env, **extra_env},
                          capture_output=True, text=True, timeout=60)


def test_an_unknown_mooncake_protocol_is_refused_with_the_choices() -> None:
    with pytest.raises(InvalidRequestError, match=r"\['tcp', 'rdma', 'nvlink_intra'\], got 'nvlink'"):
        make_connector("mooncake", layout=LAYOUT, protocol="nvlink")


def test_nvlink_intra_without_its_variable_fails_with_a_clear_error_not_a_crash() -> None:
    # without MC_INTRANODE_NVLINK every Mooncake build starts TCP (or RDMA): the connector says what is missing
    probe = run_probe({})
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert "REFUSED:" in probe.stdout and "MC_INTRANODE_NVLINK=1" in probe.stdout, probe.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA build of Mooncake starts nvlink_intra here")
def test_nvlink_intra_on_a_build_without_cuda_fails_with_a_clear_error() -> None:
    probe = run_probe({"MC_INTRANODE_NVLINK": "1"})
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert "REFUSED:" in probe.stdout and "CUDA build" in probe.stdout, probe.stdout


@pytest.fixture(scope="module")
def peers() -> Iterator[tuple[PeerProcess, PeerProcess]]:
    prefill = PeerProcess("mooncake", num_blocks=8, block_bytes=256, seed=1, wait=False)
    decode = PeerProcess("mooncake", num_blocks=8, block_bytes=256, seed=2, wait=False)
    try:
        yield prefill.wait_ready(), decode.wait_ready()
    finally:
        prefill.stop()
        decode.stop()


def with_record(metadata: bytes, **changes: object) -> bytes:
    """The peer's envelope with its Mooncake endpoint record changed (None drops a field)."""
    envelope = PeerEnvelope.decode(metadata)
    record = {**json.loads(envelope.payload), **changes}
    record = {k: v for k, v in record.items() if v is not None}
    return replace(envelope, payload=json.dumps(record).encode()).encode()


def test_the_endpoint_record_names_the_protocol(peers: tuple[PeerProcess, PeerProcess]) -> None:
    prefill, _ = peers
    assert json.loads(PeerEnvelope.decode(prefill.metadata).payload)["protocol"] == "tcp"


def test_a_peer_running_another_protocol_is_refused(peers: tuple[PeerProcess, PeerProcess]) -> None:
    prefill, decode = peers
    with pytest.raises(RemoteError) as error:
        decode.call("add_peer", with_record(prefill.metadata, protocol="nvlink_intra"))
    assert error.value.type_name == "IncompatiblePeerError", error.value
    assert "protocol ours 'tcp', peer 'nvlink_intra'" in error.value.message
    with pytest.raises(RemoteError) as error:
        decode.call("add_peer", with_record(prefill.metadata, protocol=None))
    assert error.value.type_name == "InvalidMetadataError" and "'protocol'" in error.value.message, error.value
    peer_id = decode.call("add_peer", prefill.metadata)  # the genuine record still pairs, and reads
    assert decode.call("read", peer_id, [3], [5], 5.0)["status"] == "DONE"
    assert (decode.call("blocks")[5] == prefill.initial_blocks()[3]).all()
