"""The two processes of bench/kv_handoff_gpu.py: the prefill side P that owns the blocks being read (`serve`), and
the decode side D that moves them and times it (`measure`). Each starts from a `WorkerSpec` and sets the transport
environment it was launched with before importing torch or a transfer library.

Verification: before a case is timed, D overwrites its destination blocks with fresh random values, moves the
blocks once, and compares per-block digests computed on the device on both sides (P answers for its blocks over
the pipe); a mismatch fails the case. The digest of a block is the sum of its 32-bit words, each weighted by its
position, in wrapping int64 arithmetic: equal bytes give equal digests whatever the reduction order, a moved or
missing word does not.
"""

from __future__ import annotations

import os
import statistics
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128  # Llama-3.1-8B: 8 KV heads of 128, blocks of 16 tokens


@dataclass(frozen=True)
class Case:
    tokens: int
    layout: str  # "contiguous" or "scattered"
    remote_ids: tuple[int, ...]  # P's blocks
    local_ids: tuple[int, ...]  # D's blocks, pairwise


@dataclass(frozen=True)
class WorkerSpec:
    backend: str  # a kvtransfer backend, "nixl-write" (raw NIXL WRITE) or "copy" (device copies in one process)
    device: str  # "cuda" or "cpu"
    num_layers: int
    pool_blocks: int
    cases: tuple[Case, ...]
    warmup: int
    repeats: int
    env: dict[str, str] = field(default_factory=dict)
    connector_options: dict[str, Any] = field(default_factory=dict)
    read_timeout_s: float = 120.0
    # on cuda: the GPUs of P's pool and D's (bench/kv_handoff_gpu.py --devices); the copy baseline's source pool
    # sits on P's GPU, so with two GPUs it is a plain device-to-device copy between them
    prefill_device_index: int = 0
    decode_device_index: int = 0

    def torch_device(self, side: str) -> str:
        """"cpu", or "cuda:N" of side "prefill" or "decode"."""
        if self.device != "cuda":
            return self.device
        return f"cuda:{self.prefill_device_index if side == 'prefill' else self.decode_device_index}"


def pool_shape(spec: WorkerSpec) -> tuple[int, ...]:
    """The engine's block-major layout: [num_blocks, num_layers, 2 (k, v), block_size, num_kv_heads, head_dim]."""
    return (spec.pool_blocks, spec.num_layers, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)


def make_pool(spec: WorkerSpec, seed: int, side: str) -> Any:
    import torch

    device = spec.torch_device(side)
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(pool_shape(spec), dtype=torch.bfloat16, device=device, generator=generator)


def block_digests(pool: Any, block_ids: Any) -> list[int]:
    import torch

    words = pool.view(pool.shape[0], -1).view(torch.int32)  # [num_blocks, words per block]
    weights = torch.arange(1, words.shape[1] + 1, device=pool.device, dtype=torch.int64)
    ids = torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=pool.device)
    chunk = 64 if pool.is_cuda else 8  # bounds the int64 temporary (64 blocks of 2 MiB: 1 GiB)
    return [int(d) for start in range(0, ids.numel(), chunk)
            for d in (words[ids[start:start + chunk]].to(torch.int64) * weights).sum(dim=1).tolist()]


def scramble(pool: Any, block_ids: Any) -> None:
    """New random values in these blocks, so that a move that does not happen cannot pass the check."""
    import torch

    ids = torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=pool.device)
    pool[ids] = torch.randn((ids.numel(), *pool.shape[1:]), dtype=pool.dtype, device=pool.device)


def synchronize(spec: WorkerSpec) -> None:
    """P's and D's GPUs (a cross-GPU copy runs on either side's stream)."""
    if spec.device == "cuda":
        import torch

        for index in sorted({spec.prefill_device_index, spec.decode_device_index}):
            torch.cuda.synchronize(index)


def _apply_environment(spec: WorkerSpec) -> None:
    # This process's launcher part: the transport libraries read these at import or initialisation.
    os.environ.update(spec.env)


def _layout(spec: WorkerSpec) -> Any:
    from kvtransfer import KVLayout

    return KVLayout(model="bench-llama-3.1-8b-shape", dtype="bfloat16", num_layers=spec.num_layers,
                    num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE, tp_size=1)


def _make_connector(spec: WorkerSpec) -> Any:
    from kvtransfer import make_connector

    backend = "nixl" if spec.backend == "nixl-write" else spec.backend  # P of a raw WRITE is a NIXL connector
    return make_connector(backend, layout=_layout(spec), read_timeout_s=spec.read_timeout_s,
                          **spec.connector_options)


def serve(link: Connection, spec: WorkerSpec) -> None:
    """P: registers its pool, sends ("ready", metadata) to D, then makes progress and answers ("digests", ids)
    until ("stop", None)."""
    _apply_environment(spec)
    try:
        from kvtransfer import KVRegion

        if spec.device == "cuda":
            import torch

            torch.cuda.set_device(spec.prefill_device_index)
        pool = make_pool(spec, seed=1, side="prefill")
        connector = _make_connector(spec)
        link.send(("ready", connector.register(KVRegion.from_buffer(pool))))
    except Exception as e:
        link.send(("error", f"P could not start: {type(e).__name__}: {e}"))
        return
    while True:
        if link.poll(0.0002):
            command, argument = link.recv()
            if command == "stop":
                break
            link.send(block_digests(pool, argument))
        connector.progress()
    connector.close()


class _Mover:
    """One way of moving a case's blocks from P's pool into D's (or, for WRITE, D's into P's): `move` once,
    returning the seconds it took, and the digests of the source and destination blocks."""

    op = "READ"

    def __init__(self, spec: WorkerSpec, pool: Any, link: Connection | None) -> None:
        self.spec, self.pool, self.link = spec, pool, link
        self.details: dict[str, Any] = {}

    def move(self, case: Case) -> float:
        raise NotImplementedError

    def remote_digests(self, case: Case) -> list[int]:
        assert self.link is not None, "a mover with a peer has a link to it"
        self.link.send(("digests", list(case.remote_ids)))
        return self.link.recv()

    def verify(self, case: Case) -> bool:
        """Fresh values in D's blocks (the destination of a READ or copy, the source of a WRITE), one move, then
        P's and D's digests must agree."""
        scramble(self.pool, case.local_ids)
        synchronize(self.spec)
        self.move(case)
        return self.remote_digests(case) == block_digests(self.pool, case.local_ids)

    def close(self) -> None:
        pass


class _ConnectorRead(_Mover):
    """READ through our connector: timed from `read()` until `poll()` answers DONE."""

    def __init__(self, spec: WorkerSpec, pool: Any, link: Connection, peer_metadata: bytes) -> None:
        super().__init__(spec, pool, link)
        from kvtransfer import KVRegion

        self.connector = _make_connector(spec)
        self.connector.register(KVRegion.from_buffer(pool))
        self.peer = self.connector.add_peer(peer_metadata)
        self.details = {"backend_params": getattr(self.connector, "backend_params", None)}

    def move(self, case: Case) -> float:
        from kvtransfer import TransferStatus

        remote, local = np.asarray(case.remote_ids), np.asarray(case.local_ids)
        start = time.perf_counter()
        handle = self.connector.read(self.peer, remote, local)
        while (status := self.connector.poll(handle)) is TransferStatus.PENDING:
            self.connector.progress()
        elapsed = time.perf_counter() - start
        if status is not TransferStatus.DONE:
            raise RuntimeError(f"read failed: {self.connector.failure_reason(handle)}")
        return elapsed

    def close(self) -> None:
        self.connector.close()


class _NixlWrite(_Mover):
    """WRITE (D's blocks into P's, the same bytes and descriptors as the READ) with the raw NIXL API, timed from
    building the transfer until NIXL answers DONE. UCX settings as the connector would choose them."""

    op = "WRITE"

    def __init__(self, spec: WorkerSpec, pool: Any, link: Connection, peer_metadata: bytes) -> None:
        super().__init__(spec, pool, link)
        from nixl._api import nixl_agent, nixl_agent_config

        from kvtransfer.handshake import PeerEnvelope
        from kvtransfer.nixl import block_descriptors
        from kvtransfer.ucx_config import (
            UcxConfig,
            default_ucx_config,
            loaded_ucp_library,
            nixl_backend_params,
            parse_ucx_config,
            refused_items,
        )

        kind = "VRAM" if pool.is_cuda else "DRAM"
        given = spec.connector_options.get("ucx_config")
        settings = (parse_ucx_config(given) if given is not None else UcxConfig()).over(
            default_ucx_config(PeerEnvelope.decode(peer_metadata).memory_kind))
        params = nixl_backend_params(settings, spec.connector_options.get("ucx_devices"))
        self.agent = nixl_agent(f"bench-writer-{os.getpid()}", nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=[]))
        self.agent.get_plugin_params("UCX")
        library = loaded_ucp_library()
        if library and settings.items and (refused := refused_items(settings, library)):
            raise RuntimeError(f"UCX refuses {refused}")
        self.agent.create_backend("UCX", params)
        device_id = (pool.device.index or 0) if pool.is_cuda else 0
        base, num_blocks = pool.data_ptr(), pool.shape[0]
        block_bytes = pool[0].numel() * pool.element_size()
        self.agent.register_memory([(base, num_blocks * block_bytes, device_id, "")], kind)
        envelope = PeerEnvelope.decode(peer_metadata)
        name = self.agent.add_remote_agent(envelope.payload)
        name = name.decode() if isinstance(name, bytes) else str(name)
        self.local_blocks = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", block_descriptors(base, num_blocks, block_bytes, device_id), kind)
        self.remote_blocks = self.agent.prep_xfer_dlist(
            name, block_descriptors(envelope.base_address, envelope.num_blocks, envelope.block_bytes,
                                    envelope.device_id), envelope.memory_kind.value)
        self.details = {"backend_params": dict(self.agent.get_backend_params("UCX"))}

    def move(self, case: Case) -> float:
        from kvtransfer.descriptors import coalesce_runs

        start = time.perf_counter()  # building the transfer counts, as it does inside a connector's read()
        remote_indices, local_indices = coalesce_runs(case.remote_ids, case.local_ids).block_indices()
        xfer = self.agent.make_prepped_xfer("WRITE", self.local_blocks, local_indices.astype(np.int32),
                                            self.remote_blocks, remote_indices.astype(np.int32))
        state = self.agent.transfer(xfer)
        while state == "PROC":
            state = self.agent.check_xfer_state(xfer)
        elapsed = time.perf_counter() - start
        xfer.release()
        if state != "DONE":
            raise RuntimeError(f"NIXL WRITE ended {state}")
        return elapsed


class _DeviceCopy(_Mover):
    """The baseline: the same blocks copied inside one process, one `copy_` per run (one for a contiguous case),
    from a second pool standing for P's (on P's GPU), timed with both devices synchronised before and after."""

    op = "copy"

    def __init__(self, spec: WorkerSpec, pool: Any) -> None:
        super().__init__(spec, pool, None)
        self.source = make_pool(spec, seed=3, side="prefill")

    def move(self, case: Case) -> float:
        from kvtransfer.descriptors import coalesce_runs

        runs = coalesce_runs(case.remote_ids, case.local_ids).to_list()
        synchronize(self.spec)
        start = time.perf_counter()
        for remote, local, length in runs:
            self.pool[local:local + length].copy_(self.source[remote:remote + length])
        synchronize(self.spec)
        return time.perf_counter() - start

    def remote_digests(self, case: Case) -> list[int]:
        return block_digests(self.source, case.remote_ids)


def measure(results: Connection, link: Connection | None, spec: WorkerSpec) -> None:
    """D: moves every case `warmup` times, verifies it once, then times `repeats` moves; sends ("done", rows) or
    ("error", text) to `results`, and ("stop", None) to P."""
    _apply_environment(spec)
    mover: _Mover | None = None
    try:
        if spec.device == "cuda":
            import torch

            torch.cuda.set_device(spec.decode_device_index)
        pool = make_pool(spec, seed=2, side="decode")
        if spec.backend == "copy":
            mover = _DeviceCopy(spec, pool)
        else:
            assert link is not None, "a transfer needs P"
            if not link.poll(300):
                raise RuntimeError("P did not start in 300 s")
            kind, payload = link.recv()
            if kind == "error":
                raise RuntimeError(payload)
            mover = (_NixlWrite if spec.backend == "nixl-write" else _ConnectorRead)(spec, pool, link, payload)
        rows = [_measure_case(mover, case, spec) for case in spec.cases]
        results.send(("done", rows))
    except Exception as e:
        results.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"))
    finally:
        if mover is not None:
            mover.close()
        if link is not None:
            try:
                link.send(("stop", None))
            except OSError:  # P is gone already (it could not start)
                pass


def _measure_case(mover: _Mover, case: Case, spec: WorkerSpec) -> dict[str, Any]:
    from kvtransfer.descriptors import coalesce_runs

    for _ in range(spec.warmup):
        mover.move(case)
    verified = mover.verify(case)
    if not verified:
        raise RuntimeError(f"{spec.backend} {mover.op} {case.tokens} tokens {case.layout}: the bytes did not land")
    seconds = [mover.move(case) for _ in range(spec.repeats)]
    num_bytes = len(case.remote_ids) * mover.pool[0].numel() * mover.pool.element_size()
    median = statistics.median(seconds)
    return {"backend": spec.backend, "op": mover.op, "tokens": case.tokens, "layout": case.layout,
            "blocks": len(case.remote_ids), "descriptors": len(coalesce_runs(case.remote_ids, case.local_ids)),
            "bytes": num_bytes, "median_ms": median * 1e3, "best_ms": min(seconds) * 1e3,
            "median_gb_s": num_bytes / median / 1e9, "best_gb_s": num_bytes / min(seconds) / 1e9,
            "verified": verified, "device_name": device_name(spec.device),
            "devices": f"{spec.torch_device('prefill')} -> {spec.torch_device('decode')}", **mover.details}


def device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return str(torch.cuda.get_device_name())
    import platform

    return platform.processor() or platform.machine()
