"""Which device an engine runs on, and how much of a GPU's memory it may take.

GPU memory follows vLLM's `gpu_memory_utilization`: the fraction of the GPU's *total* memory this engine
instance may use for everything it allocates (weights, activations, KV cache), so several engines (a prefill
and a decode node) can share one GPU, each with its own fraction (0.45 + 0.45). The KV cache gets what is left:

    kv_cache = total * utilization - model (what the process holds after loading) - activations (profiled peak)

Outside the fraction stay the CUDA context and the libraries' workspaces (a few hundred MiB per process, as in
vLLM): fractions of the engines on one GPU should add up to about 0.9, not 1.0.

Another process may already hold part of the GPU. The engine never allocates into an out-of-memory error: if the
device's free memory cannot hold what the engine still has to allocate, it fails with both numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GIB = 1 << 30


class GpuMemoryError(RuntimeError):
    """The GPU cannot hold what this engine is configured to take; the message says what to change."""


class DeviceError(ValueError):
    """The device asked for does not exist on this machine."""


def resolve_device(name: str) -> torch.device:
    """'auto' (CUDA when there is one, else CPU), 'cpu', 'cuda' or 'cuda:N' (EngineConfig checked the form).
    Asking for a GPU that is not there is a clear error, never a CUDA assertion deep in the first allocation.

    A CUDA device always comes back with its index ('cuda' and 'auto' name the current one, cuda:0 where Ray's
    CUDA_VISIBLE_DEVICES shows one GPU): torch.cuda.set_device refuses an index-less device, and a tensor's
    device (always indexed) would never compare equal to one. `tandem serve` and the Helm chart pass 'cuda'."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise DeviceError(f"device {name!r}: this machine has no CUDA device that torch {torch.__version__} can "
                          "use; pass --device cpu (or auto)")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        visible = ", ".join(f"cuda:{i}" for i in range(count))
        raise DeviceError(f"device {name!r} does not exist: this process sees {count} CUDA device"
                          f"{'s' if count != 1 else ''} ({visible})")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB"


@dataclass(frozen=True)
class GpuMemoryPlan:
    """How an engine's share of a GPU divides, in bytes."""

    total: int  # the GPU's memory
    utilization: float  # the engine's fraction of `total`
    model: int  # what the process holds once the model is loaded (weights, rotary tables)
    activations: int  # the profiled peak of the largest step beyond the model (and the decode graphs')
    kv_cache: int  # what is left for the KV cache

    @property
    def allowed(self) -> int:
        return int(self.total * self.utilization)


def plan_gpu_memory(total: int, utilization: float, model: int, activations: int, free: int) -> GpuMemoryPlan:
    """The KV cache's budget within the engine's share, checked against what the device has free.

    `free` is the device's free memory now (every process's use taken out), after the model is loaded and the
    profiling step's memory returned: the engine still has to allocate the KV cache and, as steps run, the
    activations. Raises GpuMemoryError when the share leaves nothing for the KV cache, or when the device has
    less free than the engine still needs (another process holds it)."""
    assert 0.0 < utilization <= 1.0, f"utilization must be in (0, 1], got {utilization}"
    allowed = int(total * utilization)
    kv_cache = allowed - model - activations
    if kv_cache <= 0:
        raise GpuMemoryError(
            f"gpu_memory_utilization={utilization:g} lets this engine use {gib(allowed)} of the GPU's "
            f"{gib(total)}, but the model takes {gib(model)} and a step's activations {gib(activations)}, which "
            "leaves nothing for the KV cache: raise --gpu-memory-utilization, or lower --max-num-batched-tokens")
    needed = kv_cache + activations
    if free < needed:
        others = max(0, total - free - model)
        raise GpuMemoryError(
            f"the GPU has {gib(free)} free, but this engine needs {gib(needed)} more (a KV cache of "
            f"{gib(kv_cache)} and {gib(activations)} of activations) to use gpu_memory_utilization="
            f"{utilization:g} of its {gib(total)}: other processes hold {gib(others)} of it. Lower "
            "--gpu-memory-utilization (engines sharing a GPU each take their part, e.g. 0.45 for two), or free "
            "the GPU")
    return GpuMemoryPlan(total=total, utilization=utilization, model=model, activations=activations,
                         kv_cache=kv_cache)


def check_free_memory(free: int, needed: int, what: str) -> None:
    """A KV cache whose size the user fixed (num_kv_blocks, kv_cache_memory_bytes) must still fit what is free."""
    if free < needed:
        raise GpuMemoryError(f"the GPU has {gib(free)} free, but {what} needs {gib(needed)}: ask for a smaller "
                             "KV cache, or free the GPU")
