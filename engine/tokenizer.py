"""Loads the model directory's tokenizer with transformers, offline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.config import ModelConfigError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: Path) -> Any:
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelConfigError(f"{path} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); "
                               f"pass token ids with skip_tokenizer_init=True, or add a tokenizer")
    from transformers import AutoTokenizer  # heavy: only when a tokenizer is wanted

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelConfigError(f"cannot load the tokenizer in {path}: {e}") from e
