"""UCX settings for NIXL's UCX backend: parsed, defaulted by memory kind, and checked by UCX itself.

NIXL 1.5.1 takes UCX settings per backend, as one parameter of the UCX plugin (read in its source,
src/plugins/ucx/ucx_utils.cpp, nixlUcxContext, and confirmed on the installed wheel):

    agent.create_backend("UCX", {"ucx_devices": "lo", "engine_config": "CUDA_IPC_ENABLE_GET_ZCOPY=y,RNDV_THRESH=inf"})

The plugin splits `engine_config` on ',' and on the first '=', and applies each item with `ucp_config_modify` to
the UCX context it creates. Four traps, each closed here:
- Keys are UCX's without the `UCX_` prefix (`UCX_TLS=tcp` is refused): a given prefix is stripped.
- A value cannot hold a comma, so list settings (`UCX_TLS=cuda_ipc,cuda_copy,tcp`) cannot pass; such an item is
  refused with a pointer to the launcher's environment (`tandem serve --transport-env`).
- An item UCX refuses (unknown key, a key of a transport module not loaded here such as `CUDA_IPC_*` on a machine
  without CUDA, a bad value) is ignored by NIXL with a debug log line only: `refused_items` asks the very libucp
  NIXL loaded, so a setting that would silently not apply is an error instead.
- A `UCX_<KEY>` variable in the process environment wins over the same key here (NIXL's rule): the launcher's
  environment beats the settings for that key.

The GPU default: UCX allows GET (what a READ is) over `cuda_ipc` only when NVML reports NVLink. Where it does not
(the H200 VM, PCIe GPUs), NIXL's READs between two processes fall back to UCX's software emulation over TCP:
0.6 GB/s instead of 1.5 TB/s (one region) or 250 GB/s (128 scattered 2 MiB blocks), measured on the H200.
`CUDA_IPC_ENABLE_GET_ZCOPY=y` lifts that gate, so it is on for VRAM pools unless the settings name the key
(`CUDA_IPC_ENABLE_GET_ZCOPY=auto` restores UCX's own choice). NIXL PR 2208 (after 1.5.1) makes the same change.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass

from kvtransfer.base import MemoryKind
from kvtransfer.errors import InvalidRequestError

_KEY = re.compile(r"^[A-Z][A-Z0-9_]*$")
_ENV_PREFIX = "UCX_"


@dataclass(frozen=True)
class UcxConfig:
    """UCX settings as (key without the UCX_ prefix, value) pairs, in order; each key at most once."""

    items: tuple[tuple[str, str], ...] = ()

    @property
    def keys(self) -> frozenset[str]:
        return frozenset(key for key, _ in self.items)

    @property
    def engine_config(self) -> str:
        """The string NIXL's UCX plugin takes as its `engine_config` parameter."""
        return ",".join(f"{key}={value}" for key, value in self.items)

    def over(self, defaults: UcxConfig) -> UcxConfig:
        """These settings on top of `defaults`: a key named here replaces the default's value."""
        kept = tuple((key, value) for key, value in defaults.items if key not in self.keys)
        return UcxConfig(kept + self.items)


GPU_DEFAULTS = UcxConfig((("CUDA_IPC_ENABLE_GET_ZCOPY", "y"),))


def default_ucx_config(memory_kind: MemoryKind) -> UcxConfig:
    """What a pool of this memory kind gets unless the settings name the same keys (see the module docstring)."""
    return GPU_DEFAULTS if memory_kind is MemoryKind.VRAM else UcxConfig()


def parse_ucx_config(text: str) -> UcxConfig:
    """'KEY=VALUE,KEY=VALUE' (keys with or without the UCX_ prefix) -> UcxConfig; InvalidRequestError names the
    offending item."""
    if not isinstance(text, str):
        raise InvalidRequestError(f"UCX settings are a 'KEY=VALUE,...' string, got {type(text).__name__}")
    if not text.strip():
        return UcxConfig()
    items: list[tuple[str, str]] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            raise InvalidRequestError(f"UCX settings {text!r}: an empty item (two commas in a row, or a trailing "
                                      "comma)")
        key, equals, value = (part.strip() for part in item.partition("="))
        if not equals:
            hint = ""
            if items:
                hint = (f"; NIXL splits its UCX settings on commas, so a value cannot hold one (as in "
                        f"UCX_{items[-1][0]}={items[-1][1]},{item}): give a list-valued UCX setting to the process "
                        "environment instead (tandem serve --transport-env 'UCX_TLS=a,b')")
            raise InvalidRequestError(f"UCX settings {text!r}: item {item!r} is not KEY=VALUE{hint}")
        key = key.removeprefix(_ENV_PREFIX)
        if not _KEY.match(key):
            raise InvalidRequestError(f"UCX settings {text!r}: {key!r} is not a UCX setting name (upper-case "
                                      "letters, digits and '_', e.g. CUDA_IPC_ENABLE_GET_ZCOPY)")
        if not value:
            raise InvalidRequestError(f"UCX settings {text!r}: {key} has no value")
        if any(key == seen for seen, _ in items):
            raise InvalidRequestError(f"UCX settings {text!r}: {key} is named twice")
        items.append((key, value))
    return UcxConfig(tuple(items))


def nixl_backend_params(ucx_config: UcxConfig, ucx_devices: str | None) -> dict[str, str]:
    """The parameters of NIXL's `create_backend("UCX", params)` for these settings."""
    params = {"ucx_devices": ucx_devices} if ucx_devices else {}
    if ucx_config.items:
        params["engine_config"] = ucx_config.engine_config
    return params


def loaded_ucp_library() -> str | None:
    """The path of the libucp loaded in this process (NIXL's UCX plugin brings its own copy, loaded with the
    plugin), or None when there is none or the platform does not say (no /proc)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n").rsplit("/", 1)[-1].startswith("libucp"):
                    return fields[5].rstrip("\n")
    except OSError:
        return None
    return None


def refused_items(ucx_config: UcxConfig, library: str) -> list[str]:
    """The items of `ucx_config` that the libucp at `library` refuses, as 'KEY=VALUE' (empty: all accepted).

    Applies each item to a scratch UCX configuration exactly as NIXL's plugin does (`ucp_config_read`, then
    `ucp_config_modify` per item), so the answer is UCX's own: which transport modules loaded here and which
    values they take. A value UCX accepts can still fail when the context starts (`TLS=nonexistent`): that shows
    as a failure to create the backend.
    """
    ucp = ctypes.CDLL(library)  # already loaded by NIXL's plugin: dlopen hands back that same copy
    ucp.ucp_config_read.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]
    ucp.ucp_config_read.restype = ctypes.c_int8  # ucs_status_t is a packed (one-byte) enum
    ucp.ucp_config_modify.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p]
    ucp.ucp_config_modify.restype = ctypes.c_int8
    ucp.ucp_config_release.argtypes = [ctypes.c_void_p]
    ucp.ucp_config_release.restype = None
    config = ctypes.c_void_p()
    status = ucp.ucp_config_read(None, None, ctypes.byref(config))
    if status != 0:
        raise InvalidRequestError(f"UCX could not read its configuration (status {status}) to check the UCX "
                                  "settings against it")
    try:
        return [f"{key}={value}" for key, value in ucx_config.items
                if ucp.ucp_config_modify(config, key.encode(), value.encode()) != 0]
    finally:
        ucp.ucp_config_release(config)
