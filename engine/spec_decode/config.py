"""`speculative_config`, as vLLM's users write it: `{"method": "ngram", "num_speculative_tokens": K,
"prompt_lookup_max": N, "prompt_lookup_min": M}` (a dict offline, a JSON object on the command line).

Torch-free: node flags and `tandem serve` validate it before any engine starts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram",)
# vLLM's defaults when neither lookup bound is given
DEFAULT_PROMPT_LOOKUP = 5
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


@dataclass(frozen=True)
class SpeculativeConfig:
    """N-gram speculation: look up the last n tokens (n from prompt_lookup_max down to prompt_lookup_min)
    earlier in the request's tokens and draft the `num_speculative_tokens` that followed."""

    num_speculative_tokens: int
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    method: str = "ngram"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig | None:
        """A config from what a user gives: None (off), a dict, a JSON object, or a config. ValueError with
        the reason for anything else."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config: expected a JSON object such as "
                             f'{{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}}, '
                             f"got {value!r}")
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; "
                             f"known: {', '.join(_KEYS)}")
        if "method" not in value:
            raise ValueError(f"speculative_config: 'method' is required (one of {', '.join(METHODS)})")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config: 'num_speculative_tokens' is required")
        # vLLM's rule: one bound given sets the other; neither gives both the default
        lookup_max: Any = value.get("prompt_lookup_max")
        lookup_min: Any = value.get("prompt_lookup_min")
        if lookup_max is None and lookup_min is None:
            lookup_max = lookup_min = DEFAULT_PROMPT_LOOKUP
        elif lookup_min is None:
            lookup_min = lookup_max
        elif lookup_max is None:
            lookup_max = lookup_min
        return cls(method=value["method"], num_speculative_tokens=value["num_speculative_tokens"],
                   prompt_lookup_max=lookup_max, prompt_lookup_min=lookup_min)

    def to_json(self) -> str:
        """The JSON a node's --speculative-config takes."""
        return json.dumps({key: getattr(self, key) for key in _KEYS})
