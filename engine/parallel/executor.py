"""The ranks of a tensor-parallel node: rank 0 runs the engine and drives the others, which only execute.

A node with `tensor_parallel_size=N` is N processes. Rank 0 is the node process itself: it schedules, prepares
each step's inputs on the host and samples. It starts ranks 1..N-1 as worker processes
(`python -m engine.parallel.worker`), each with its slice of the weights and its own slice of the KV pool, and
drives them over the host (gloo) group with three commands:

    STEP  the step's host inputs (StepInputs); every rank runs the same forward pass, their collectives pair up
    CALL  "module:function" + args: each rank runs function(rank_state, *args), rank 0 gathers the results (the
          node's per-rank KV transfer work goes through here: engine/ knows no transfer library)
    STOP  the workers leave their loop and exit

Keep it simple and correct first: one command broadcast per step (a pickled object over gloo), then the step's
input ids as one tensor over the device group (they may be the last step's samples, which live on rank 0's
device). A worker whose rank 0 dies fails its next collective and exits.
"""

from __future__ import annotations

import atexit
import datetime
import importlib
import logging
import pickle
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.config import EngineConfig, ModelConfig
from engine.parallel.context import ParallelContext

if TYPE_CHECKING:
    from engine.runner import ModelRunner

logger = logging.getLogger(__name__)

# The timeout of every collective of the group, the command broadcast included: a worker waits in it for as long
# as its node is idle, so it must outlast any idle spell. A dead rank 0 is noticed sooner anyway: its connections
# close (the worker's collective fails) and the worker is killed with it (engine/parallel/worker.py).
_COLLECTIVE_TIMEOUT = datetime.timedelta(days=365)


@dataclass(frozen=True)
class StepInputs:
    """One step's host inputs, what every rank turns into the same device tensors (engine/runner.py)."""

    input_ids: list[int]  # with 0 where a pending row's token (the last step's sample) goes
    positions: list[int]
    slots: list[int]
    starts: list[int]  # query_start_loc, [B+1]
    seq_lens: list[int]
    block_tables: list[int]  # [B * max_blocks], padded with 0
    max_blocks: int
    sample_rows: list[int]
    num_decodes: int
    pending_rows: list[int] = field(default_factory=list)
    pending_sources: list[int] = field(default_factory=list)
    prompt_rows: list[int] = field(default_factory=list)  # rows whose logits give prompt logprobs


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process needs to build its rank of the node (pickled to its stdin)."""

    config: EngineConfig
    model_config: ModelConfig
    max_model_len: int
    rank: int
    world_size: int
    init_method: str
    num_threads: int


_STEP, _CALL, _STOP = "step", "call", "stop"


def init_parallel(rank: int, world_size: int, init_method: str, device_type: str,
                  config: EngineConfig | None = None) -> ParallelContext:
    """Joins the node's process group: NCCL between GPUs (and a gloo group for host messages), gloo on CPU."""
    import torch.distributed as dist

    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=_COLLECTIVE_TIMEOUT)
    group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=_COLLECTIVE_TIMEOUT) if backend == "nccl" else group
    return ParallelContext(tp_rank=rank, tp_size=world_size, group=group, cpu_group=cpu_group,
                           expert_parallel=config is not None and config.enable_expert_parallel,
                           all2all_backend=config.all2all_backend if config is not None else "allgather_reducescatter")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def resolve_call(path: str) -> Callable[..., Any]:
    """"package.module:function" -> the function (imported on first use, on each rank)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


class TensorParallelWorkers:
    """Rank 0's handle on ranks 1..N-1: starts them, sends them steps and calls, stops them."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int, device_type: str
                 ) -> None:
        world_size = config.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.processes: list[subprocess.Popen[bytes]] = []
        for rank in range(1, world_size):
            spec = WorkerSpec(config, model_config, max_model_len, rank, world_size, init_method,
                              torch.get_num_threads())
            process = subprocess.Popen([sys.executable, "-m", "engine.parallel.worker"], stdin=subprocess.PIPE)
            assert process.stdin is not None
            process.stdin.write(pickle.dumps(spec))
            process.stdin.close()
            self.processes.append(process)
        try:
            self.parallel = init_parallel(0, world_size, init_method, device_type, config)
        except Exception:
            self._kill()
            raise
        self._closed = False
        atexit.register(self.close)  # an engine nobody closed still stops its workers
        logger.info("tensor parallelism: %d ranks (workers %s)", world_size, [p.pid for p in self.processes])

    def send_step(self, inputs: StepInputs) -> None:
        self.parallel.broadcast_object((_STEP, inputs))

    def call(self, path: str, rank_state: Any, *args: Any) -> list[Any]:
        """Runs `path`(state, *args) on every rank (rank 0's `rank_state` here); the results in rank order. An
        exception on any rank is raised here (after every rank answered: the ranks stay in step)."""
        self.parallel.broadcast_object((_CALL, path, args))
        error: BaseException | None = None
        try:
            mine = resolve_call(path)(rank_state, *args)
        except Exception as e:
            error, mine = e, None
        results = self.parallel.gather_objects(mine)
        assert results is not None
        if error is not None:
            raise error
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.parallel.broadcast_object((_STOP,))
        except Exception:  # a worker already gone: it is killed below
            logger.debug("stopping the tensor-parallel workers", exc_info=True)
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    def _kill(self) -> None:
        for process in self.processes:
            process.kill()


class RankCallError(RuntimeError):
    """A CALL failed on some rank: the message names the rank and the error."""


def _picklable(error: Exception, where: str) -> Exception:
    """The error itself when it travels (so rank 0 raises the same type), else a RankCallError naming it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any pickling failure: send the message instead
        return RankCallError(f"{where}: {type(error).__name__}: {error}")


def worker_loop(runner: ModelRunner, parallel: ParallelContext) -> None:
    """A worker rank's life: execute what rank 0 broadcasts until STOP."""
    state = runner.rank_state
    while True:
        command = parallel.broadcast_object(None)
        kind = command[0]
        if kind == _STEP:
            runner.execute_inputs(command[1])
        elif kind == _CALL:
            _, path, args = command
            try:
                result = resolve_call(path)(state, *args)
            except Exception as e:  # reported to rank 0, which raises it; the worker stays in step
                logger.warning("rank %d: %s failed: %s", parallel.tp_rank, path, e)
                result = _picklable(e, f"rank {parallel.tp_rank}: {path}")
            parallel.gather_objects(result)
        elif kind == _STOP:
            return
