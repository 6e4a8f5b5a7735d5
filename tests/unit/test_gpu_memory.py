"""What an engine may take of its device: the device named (and refused when absent), the GPU memory budget
arithmetic of gpu_memory_utilization (checked with numbers), and the profiling step it runs before the pool exists.
The GPU behaviour itself (two engines sharing one GPU) is tests/unit/test_gpu_memory_share.py."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig, ModelConfig
from engine.device import GIB, DeviceError, GpuMemoryError, check_free_memory, plan_gpu_memory, resolve_device
from engine.model.loader import build_model
from engine.profile_run import run_dummy_step
from engine.runner import make_attention_backend
from tests.fixtures.tiny_models import TinyModelFactory

# An 80 GiB GPU, an engine whose model holds 16 GiB and whose largest step needs 2 GiB.
TOTAL = 80 * GIB
MODEL = 16 * GIB
ACTIVATIONS = 2 * GIB


@pytest.mark.parametrize(("utilization", "kv_gib"), [(0.9, 54.0), (0.45, 18.0), (0.25, 2.0), (1.0, 62.0)])
def test_the_kv_cache_gets_the_share_less_the_model_and_the_activations(utilization: float, kv_gib: float) -> None:
    plan = plan_gpu_memory(TOTAL, utilization, MODEL, ACTIVATIONS, free=TOTAL - MODEL)
    assert plan.kv_cache == pytest.approx(kv_gib * GIB, abs=1)  # 80 * u - 16 - 2
    assert plan.allowed == int(TOTAL * utilization)
    assert plan.model + plan.activations + plan.kv_cache <= plan.allowed


def test_two_engines_at_045_fit_one_gpu_between_them() -> None:
    first = plan_gpu_memory(TOTAL, 0.45, MODEL, ACTIVATIONS, free=TOTAL - MODEL)
    # the second loads its model next to the first's model, pool and (returned) activations
    free = TOTAL - (MODEL + first.kv_cache) - MODEL
    second = plan_gpu_memory(TOTAL, 0.45, MODEL, ACTIVATIONS, free=free)
    both = 2 * (MODEL + ACTIVATIONS) + first.kv_cache + second.kv_cache
    assert both <= 0.9 * TOTAL + 1 and second.kv_cache == first.kv_cache


def test_a_share_that_leaves_nothing_for_the_kv_cache_names_the_numbers() -> None:
    with pytest.raises(GpuMemoryError, match=r"gpu_memory_utilization=0\.2 lets this engine use 16\.00 GiB of the "
                                             r"GPU's 80\.00 GiB, but the model takes 16\.00 GiB"):
        plan_gpu_memory(TOTAL, 0.2, MODEL, ACTIVATIONS, free=TOTAL - MODEL)


def test_less_free_memory_than_the_engine_still_needs_is_refused_before_allocating() -> None:
    # another process holds 50 GiB: 14 GiB free, but the 0.9 share wants 54 GiB of KV cache + 2 GiB of activations
    free = TOTAL - MODEL - 50 * GIB
    with pytest.raises(GpuMemoryError) as refused:
        plan_gpu_memory(TOTAL, 0.9, MODEL, ACTIVATIONS, free=free)
    message = str(refused.value)
    assert "the GPU has 14.00 GiB free, but this engine needs 56.00 GiB more" in message
    assert "other processes hold 50.00 GiB" in message and "--gpu-memory-utilization" in message
    # exactly enough is enough
    assert plan_gpu_memory(TOTAL, 0.9, MODEL, ACTIVATIONS, free=56 * GIB).kv_cache == 54 * GIB


def test_a_fixed_kv_cache_size_is_checked_against_the_free_memory() -> None:
    check_free_memory(4 * GIB, 4 * GIB, "a KV cache of 10 blocks")
    with pytest.raises(GpuMemoryError, match=r"the GPU has 1\.00 GiB free, but a KV cache of 10 blocks needs "
                                             r"4\.00 GiB"):
        check_free_memory(GIB, 4 * GIB, "a KV cache of 10 blocks")


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_engine_config_takes_the_device_forms(device: str) -> None:
    assert EngineConfig(model="/m", device=device).device == device


@pytest.mark.parametrize(("field", "value", "message"), [
    ("device", "gpu", "device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
    ("device", "cuda:-1", "device must be"),
    ("device", "cuda:x", "device must be"),
    ("gpu_memory_utilization", 0.0, r"gpu_memory_utilization must be a fraction in \(0, 1\], got 0.0"),
    ("gpu_memory_utilization", 1.5, "gpu_memory_utilization must be a fraction"),
    ("gpu_memory_utilization", True, "gpu_memory_utilization must be a fraction"),
    ("kv_cache_memory_bytes", 0, "kv_cache_memory_bytes must be positive"),
])
def test_engine_config_refuses_bad_devices_and_shares(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="/m", **{field: value})  # type: ignore[arg-type]


def test_the_default_share_is_vllms() -> None:
    assert EngineConfig(model="/m").gpu_memory_utilization == 0.9


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_asked_on_a_machine_without_it_is_a_clear_error(device: str) -> None:
    with pytest.raises(DeviceError, match=f"device '{device}': this machine has no CUDA device"):
        resolve_device(device)
    assert resolve_device("auto") == torch.device("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_index_past_the_device_count_is_a_clear_error() -> None:
    count = torch.cuda.device_count()
    assert resolve_device(f"cuda:{count - 1}") == torch.device(f"cuda:{count - 1}")
    with pytest.raises(DeviceError, match=f"device 'cuda:{count}' does not exist: this process sees {count}"):
        resolve_device(f"cuda:{count}")


def test_the_engine_ignores_the_gpu_share_on_cpu(tiny_model: TinyModelFactory) -> None:
    from engine import LLM

    # on CPU the pool is sized as before: every seat filled to the context limit (here within the host budget)
    runner = LLM(model=str(tiny_model("llama")), dtype="float32", device="cpu", max_num_seqs=4,
                 gpu_memory_utilization=0.01).engine.runner
    assert runner.device.type == "cpu" and runner.num_blocks == 4 * (256 // 16)


@pytest.mark.parametrize(("backend", "seq_lens", "num_sampled"), [
    ("torch", [64], 8), ("torch", [1, 1, 1], 3), ("torch", [1, 40, 16], 4), ("triton", [1, 1, 20], 3)])
def test_the_profiling_step_is_a_valid_step_for_its_shapes(tiny_model: TinyModelFactory, backend: str,
                                                           seq_lens: list[int], num_sampled: int) -> None:
    # the backends run whatever metadata they get: a malformed step (decodes not first, slots outside the temporary
    # pool, a bad block table) fails in them, as it would when the runner profiles on a GPU
    cfg = ModelConfig.from_path(tiny_model("llama"))
    model = build_model(cfg, torch.float32, torch.device("cpu"), 256, "auto", 0)
    tokens = run_dummy_step(model, make_attention_backend(backend), cfg, 16, torch.float32, torch.device("cpu"),
                            seq_lens, num_sampled)
    assert len(tokens) == num_sampled and all(0 <= t < cfg.vocab_size for t in tokens)
