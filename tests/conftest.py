"""Shared pytest setup: offline Hugging Face, Triton's CPU interpreter, tiny model fixtures."""

from __future__ import annotations

import os

import torch  # noqa: E402  (imports no triton)

# Before triton is imported (it reads TRITON_INTERPRET then): with no GPU, kernels run in Triton's CPU
# interpreter; with one, they compile for it. The hub libraries read the offline switches on import too.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import json  # noqa: E402
from hashlib import sha256  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from tests.fixtures.tiny_models import TinyModelFactory, build_tiny_model, train_tokenizer  # noqa: E402
from tests.fixtures.tool_model import tool_model  # noqa: E402, F401  (a session fixture: a model that calls tools)

# Tiny models gain nothing from many threads, and parallel test workers would oversubscribe the CPU: one thread
# each when pytest-xdist runs the suite on several workers (`make unit`).
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)

# `make unit` runs the suite on pytest-xdist workers with `--dist loadfile`: a file's tests stay on one worker, so
# the module-scoped clusters and peers of the integration and transfer tests start once. These files also share a
# worker, one after the other: both start a local Ray instance (ray.init(address="local")), or both use the
# SmolLM2 oracle, a session fixture that takes a while to load.
_SHARED_WORKER = {
    "tests/integration/test_cluster.py": "local-ray",
    "tests/integration/test_gpu_placement.py": "local-ray",
    "tests/integration/test_real_model.py": "smollm2",
    "tests/unit/test_smollm2.py": "smollm2",
}


@pytest.hookimpl(optionalhook=True)  # an xdist hook: absent without pytest-xdist
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--reliability-report", default=None, metavar="PATH",
                     help="merge the fault suite's rows into this markdown file, e.g. bench/results/reliability-"
                          "$(date +%%F).md (default: none: a test run writes no tracked file)")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile` with the files of _SHARED_WORKER grouped. (Not xdist_group marks with `--dist loadgroup`:
    xdist 3.8 renames the test ids to group them, which pytest 9.2 no longer lets it do.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LoadFileOrGroupScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return _SHARED_WORKER.get(path, path)

    return LoadFileOrGroupScheduling(config, log)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny byte-level BPE tokenizer, trained once per session."""
    out_dir = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> TinyModelFactory:
    """``tiny_model(arch, **overrides) -> Path``: a tiny model directory, built once per arguments.

    Overrides are those of ``build_tiny_model`` (``max_shard_size=`` and config fields).
    """
    root = tmp_path_factory.mktemp("tiny_models")
    built: dict[str, Path] = {}

    def make(arch: str, **overrides: Any) -> Path:
        key = json.dumps({"arch": arch, **overrides}, sort_keys=True)
        if key not in built:
            out_dir = root / f"{arch}-{sha256(key.encode()).hexdigest()[:12]}"
            built[key] = build_tiny_model(arch, out_dir, tokenizer_dir=tokenizer_dir, **overrides)
        return built[key]

    return make


@pytest.fixture(scope="session")
def smollm2_oracle() -> Any:
    """transformers' own reading of the SmolLM2 GGUF (float32), the real-model tests' oracle: loaded once."""
    from engine.gguf_config import smollm2_gguf_path
    from tests.fixtures.gguf_models import load_gguf_oracle

    return load_gguf_oracle(smollm2_gguf_path())
