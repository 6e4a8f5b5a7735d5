"""The one module that reads environment variables (production code asks here; libraries never read or write
`os.environ`). Settings come from `TANDEM_*` variables through `settings.spec.resolve`; the rest are named below."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path


def settings_layer() -> Mapping[str, str]:
    """The environment as the `TANDEM_*` layer of settings (`settings.spec.resolve` reads its own names)."""
    return os.environ


def log_level(default: str = "INFO") -> str:
    return os.environ.get("TANDEM_LOG_LEVEL") or default


def admin_url() -> str | None:
    """The admin API of a remote cluster, for `tandem status` / `tandem scale`."""
    return os.environ.get("TANDEM_ADMIN_URL") or None


def admin_token() -> str | None:
    return os.environ.get("TANDEM_ADMIN_TOKEN") or None


def api_key() -> str | None:
    """The proxy's client key: `tandem serve` hands it over in the environment, not on a command line."""
    return os.environ.get(API_KEY_VAR) or None


API_KEY_VAR = "TANDEM_API_KEY"


POD_UID_VAR = "TANDEM_POD_UID"


def pod_uid() -> str | None:
    """The Kubernetes pod's UID (the chart sets it from the downward API's `metadata.uid`); None off Kubernetes.
    A node publishes it in its registry record so a record can be traced to the pod that wrote it."""
    return os.environ.get(POD_UID_VAR) or None


def cache_dir() -> Path:
    """$TANDEM_CACHE_DIR, else $XDG_CACHE_HOME/tandem, else ~/.cache/tandem."""
    if os.environ.get("TANDEM_CACHE_DIR"):
        return Path(os.environ["TANDEM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tandem"


# What every Tandem child process starts with unless the parent's environment or the launcher says otherwise:
# transport libraries log warnings and errors only.
CHILD_DEFAULTS = {"PYTHONUNBUFFERED": "1", "NIXL_LOG_LEVEL": "WARN", "MC_LOG_LEVEL": "WARNING"}
# a test harness's setting, never a served node's (kernels would run in Triton's interpreter)
NOT_INHERITED = ("TRITON_INTERPRET",)


def child_environment(overrides: Mapping[str, str] | None = None, remove: Iterable[str] = ()) -> dict[str, str]:
    """The environment of a child process: this one's, the defaults above where unset, then `overrides`."""
    env = {**CHILD_DEFAULTS, **os.environ, **(overrides or {})}
    for name in (*NOT_INHERITED, *remove):
        env.pop(name, None)
    return env
