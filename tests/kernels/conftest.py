"""Kernel tests run two ways: interpreted on CPU tensors (TRITON_INTERPRET=1, the default that tests/conftest.py
sets) and compiled on a GPU (the `gpu` marker; run them with TRITON_INTERPRET=0 on a CUDA machine)."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@pytest.fixture(autouse=True)
def _pick_kernel_mode(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("gpu") is not None:
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        if INTERPRETED:
            pytest.skip("TRITON_INTERPRET=1 would interpret the GPU kernels: run with TRITON_INTERPRET=0")
    elif not INTERPRETED:
        pytest.skip("CPU kernel tests need Triton's interpreter (TRITON_INTERPRET=1)")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
