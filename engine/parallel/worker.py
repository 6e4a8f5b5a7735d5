"""A tensor-parallel worker rank: `python -m engine.parallel.worker`, started by rank 0 (engine/parallel/executor.py)
with its WorkerSpec pickled on stdin. It builds its rank of the model and KV pool and executes rank 0's steps."""

from __future__ import annotations

import ctypes
import logging
import pickle
import signal
import sys

import torch


def _follow_rank0() -> None:
    """A worker ends when rank 0 tells it to (STOP) or dies: SIGTERM/SIGINT sent to the node's process group are
    rank 0's to handle (it drains, then stops its workers), and rank 0's death kills the worker (Linux)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


def main() -> None:
    from engine.parallel.executor import WorkerSpec, init_parallel, worker_loop
    from engine.runner import ModelRunner

    _follow_rank0()
    spec: WorkerSpec = pickle.loads(sys.stdin.buffer.read())
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s tp-rank{spec.rank} %(name)s: %(message)s")
    torch.set_num_threads(spec.num_threads)
    from engine.device import resolve_device

    device_type = resolve_device(spec.config.device).type
    parallel = init_parallel(spec.rank, spec.world_size, spec.init_method, device_type, spec.config)
    runner = ModelRunner(spec.config, spec.model_config, spec.max_model_len, parallel=parallel)
    try:
        worker_loop(runner, parallel)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
