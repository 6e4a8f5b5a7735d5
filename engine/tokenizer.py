"""Loads the model's tokenizer with transformers, offline: a Hugging Face directory's tokenizer files, or the
vocabulary, merges and chat template in a GGUF file's metadata."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.config import ModelConfigError
from engine.gguf_config import find_gguf_file

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: Path) -> Any:
    """`path`: a model directory, a .gguf file or a directory holding one (what ModelConfig.from_path takes)."""
    gguf_file = find_gguf_file(path)
    if gguf_file is not None:
        return _load_gguf_tokenizer(gguf_file)
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelConfigError(f"{path} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); "
                               f"pass token ids with skip_tokenizer_init=True, or add a tokenizer")
    from transformers import AutoTokenizer  # heavy: only when a tokenizer is wanted

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelConfigError(f"cannot load the tokenizer in {path}: {e}") from e


def _load_gguf_tokenizer(gguf_file: Path) -> Any:
    # The fast tokenizer class converts the GGUF vocabulary itself (special tokens, pre-tokenizer, chat template).
    # AutoTokenizer would get there too, after reading the whole file a second time for the model's config.
    from transformers import PreTrainedTokenizerFast

    try:
        return PreTrainedTokenizerFast.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                       local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelConfigError(f"cannot build a tokenizer from {gguf_file}'s metadata: {e}") from e
