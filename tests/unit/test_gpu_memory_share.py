"""Engines sharing one GPU through gpu_memory_utilization, each in its own process as a prefill and a decode node
would be: two at 0.4 fit and generate, a third finds too little free and says so, and the KV pool follows the
fraction. Needs CUDA.

The model is tiny in weights but wide in KV (8 KV heads of 128, a 64k context), so the pool's size is set by the
GPU share, not by every seat filled to the context limit."""

from __future__ import annotations

import json
import selectors
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [5, 6, 7, 8, 9]
MiB = 1 << 20

# Loads an engine with the given share, generates, reports, then holds the GPU until its stdin closes.
ENGINE_PROCESS = """
import json, sys
import torch
from engine import LLM, SamplingParams
from engine.device import GpuMemoryError

try:
    llm = LLM(model=sys.argv[1], dtype="float32", gpu_memory_utilization=float(sys.argv[2]))
except GpuMemoryError as e:
    print(json.dumps({"error": str(e)}), flush=True)
    sys.exit(3)
runner = llm.engine.runner
params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
tokens = llm.generate([json.loads(sys.argv[3])], params)[0].outputs[0].token_ids
torch.cuda.synchronize()
print(json.dumps({"kv_bytes": runner.num_blocks * runner.block_bytes, "num_blocks": runner.num_blocks,
                  "block_bytes": runner.block_bytes, "reserved": torch.cuda.memory_reserved(),
                  "total": torch.cuda.mem_get_info()[1], "tokens": list(tokens)}), flush=True)
sys.stdin.readline()
"""


class EngineProcess:
    def __init__(self, model: Path, share: float, log_path: Path) -> None:
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.popen = subprocess.Popen([sys.executable, "-c", ENGINE_PROCESS, str(model), str(share),
                                           json.dumps(PROMPT)], cwd=ROOT, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=log, text=True)

    def report(self, timeout: float = 300.0) -> dict[str, Any]:
        """The process's one JSON line (its numbers, or the error it stopped with)."""
        assert self.popen.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.popen.stdout, selectors.EVENT_READ)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if selector.select(timeout=1.0):
                    line = self.popen.stdout.readline()
                    if line.startswith("{"):
                        return dict(json.loads(line))
                    if not line:  # exited without a report
                        break
        raise AssertionError(f"no report from the engine process:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            assert self.popen.stdin is not None
            self.popen.stdin.close()
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


@pytest.fixture
def engines() -> Iterator[list[EngineProcess]]:
    started: list[EngineProcess] = []
    yield started
    for engine in started:
        engine.stop()


@pytest.fixture(scope="module")
def wide_kv_model(tiny_model: TinyModelFactory) -> Path:
    return tiny_model("llama", num_attention_heads=8, num_key_value_heads=8, head_dim=128,
                      max_position_embeddings=65536)


def weight_bytes(model: Path) -> int:
    """The checkpoint's tensors, as the engine holds them in float32 (the oracle for the model's part)."""
    with safe_open(str(model / "model.safetensors"), framework="pt") as f:
        return sum(f.get_tensor(name).numel() * 4 for name in f.keys())  # noqa: SIM118 - not a mapping


def test_two_engines_at_04_share_one_gpu_and_a_third_is_refused(wide_kv_model: Path, engines: list[EngineProcess],
                                                                tmp_path: Path) -> None:
    first = EngineProcess(wide_kv_model, 0.4, tmp_path / "first.log")
    engines.append(first)
    a = first.report()
    second = EngineProcess(wide_kv_model, 0.4, tmp_path / "second.log")  # while the first holds its share
    engines.append(second)
    b = second.report()
    assert "error" not in a and "error" not in b, (a, b)
    expected = hf_greedy(wide_kv_model, [PROMPT], 6)[0]
    assert a["tokens"] == b["tokens"] == expected

    total, weights = a["total"], weight_bytes(wide_kv_model)
    for numbers in (a, b):
        # the pool is the share less the model and a step's activations (a tiny model's: well under 1 GiB)
        assert 0.4 * total - weights - 1024 * MiB <= numbers["kv_bytes"] <= 0.4 * total - weights
        # and everything torch holds stays within the share (graph pools included)
        assert numbers["reserved"] <= 0.4 * total + 64 * MiB

    third = EngineProcess(wide_kv_model, 0.4, tmp_path / "third.log")
    engines.append(third)
    refused = third.report()
    assert third.popen.wait(60) == 3
    assert "the GPU has" in refused["error"] and "free, but this engine needs" in refused["error"]


def test_the_kv_pool_follows_the_fraction(wide_kv_model: Path, engines: list[EngineProcess], tmp_path: Path) -> None:
    sizes = {}
    for share in (0.2, 0.4):
        engine = EngineProcess(wide_kv_model, share, tmp_path / f"{share}.log")
        engines.append(engine)
        sizes[share] = engine.report()
        engine.stop()
    total, block_bytes = sizes[0.4]["total"], sizes[0.4]["block_bytes"]
    # same model, same activations: the difference is exactly the difference of the shares, to a block
    assert abs(sizes[0.4]["kv_bytes"] - sizes[0.2]["kv_bytes"] - 0.2 * total) <= block_bytes + 16 * MiB


def test_a_fixed_pool_bigger_than_the_free_memory_is_refused_before_allocating(wide_kv_model: Path) -> None:
    from engine import LLM
    from engine.device import GpuMemoryError

    free, total = torch.cuda.mem_get_info()
    block_bytes = 2 * 2 * 16 * 8 * 128 * 4  # layers, k/v, block size, KV heads, head dim, float32
    with pytest.raises(GpuMemoryError, match=r"the GPU has .* GiB free, but a KV cache of \d+ blocks needs"):
        LLM(model=str(wide_kv_model), dtype="float32", num_kv_blocks=2 * total // block_bytes, enforce_eager=True)
    assert torch.cuda.mem_get_info()[0] >= free - 512 * MiB  # nothing big was allocated
