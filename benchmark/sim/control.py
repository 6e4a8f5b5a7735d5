"""What the controller sees: the load the simulator observed over one interval, as a LoadWindow."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cluster.planner.types import LoadWindow


@dataclass
class WindowCounter:
    """Counts over the interval that started at `start_s`."""

    start_s: float = 0.0
    arrivals: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    completed: int = 0
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)

    def arrived(self, prompt_tokens: int) -> None:
        self.arrivals += 1
        self.prompt_tokens += prompt_tokens

    def token(self, latency_s: float, first: bool) -> None:
        self.output_tokens += 1
        (self.ttfts if first else self.itls).append(latency_s)

    def close(self, now: float, percentile: float, running: int, waiting_prefill_tokens: int) -> LoadWindow:
        """The window up to `now` (start a new counter for the next one)."""
        return LoadWindow(
            start_s=self.start_s, duration_s=now - self.start_s, arrivals=self.arrivals,
            prompt_tokens=self.prompt_tokens, output_tokens=self.output_tokens, completed=self.completed,
            ttft_s=_at(self.ttfts, percentile), itl_s=_at(self.itls, percentile), running=running,
            waiting_prefill_tokens=waiting_prefill_tokens)


def _at(values: list[float], percentile: float) -> float | None:
    return float(np.percentile(values, percentile)) if values else None
