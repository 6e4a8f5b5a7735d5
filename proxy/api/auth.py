"""Who may call the proxy: its clients' API keys, sent as `Authorization: Bearer KEY`.

Keys come from --api-key (repeatable; else $TANDEM_API_KEY, how `tandem serve` hands its --api-key over) and from
--api-key-file (one key a line; blank lines and lines starting with # are skipped); none at all leaves the API open.
/health and /metrics stay open whatever the keys, as vLLM's do (probes and scrapers carry no key): keep /metrics
behind the network policy where the load it shows is private. Every other path needs a key.

How keys are kept and compared, and why:
- only SHA-256 digests of the keys are held, so no repr, log line, traceback or metric label can show a key;
- a given token is hashed and compared with every digest by hmac.compare_digest, with no early exit: the time
  taken says neither which key matched nor how long the keys are.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from pathlib import Path


class APIKeys:
    """A set of bearer tokens; empty means no key is needed."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._digests = tuple(dict.fromkeys(_digest(k) for k in keys if k))

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"APIKeys({len(self._digests)} keys)"

    def matches(self, token: str) -> bool:
        """Whether `token` is one of the keys, in time that depends only on the number of keys."""
        given = _digest(token)
        found = False
        for digest in self._digests:
            found |= hmac.compare_digest(given, digest)
        return found

    def authorizes(self, headers: Mapping[str, str]) -> bool:
        """Whether a request with these headers carries one of the keys (`Authorization: Bearer KEY`)."""
        token = bearer_token(headers)
        return token is not None and self.matches(token)


def bearer_token(headers: Mapping[str, str]) -> str | None:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def read_key_file(path: Path) -> list[str]:
    """The keys in a key file: one a line, surrounding blanks ignored; blank lines and # comments skipped.
    Raises ValueError (without quoting the file's lines) when it cannot be read or holds no key."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the API key file {path}: {e}") from None
    keys = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise ValueError(f"the API key file {path} holds no key")
    if any(any(c.isspace() for c in key) for key in keys):
        raise ValueError(f"the API key file {path}: a key must not hold blanks (one key a line)")
    return keys


def load_api_keys(flag_keys: Iterable[str] | None, key_file: str | None, env_key: str | None) -> APIKeys:
    """The keys of --api-key (every time it is given; else $TANDEM_API_KEY, as a flag beats its env var) and of
    --api-key-file, together."""
    keys = [k for k in (flag_keys or ()) if k] or ([env_key] if env_key else [])
    if key_file:
        keys += read_key_file(Path(key_file))
    return APIKeys(keys)
