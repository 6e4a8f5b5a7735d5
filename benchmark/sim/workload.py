"""Workloads for the simulator: a trace file, `tandem bench serve`'s random dataset with its arrivals, and a
day-shaped trace for comparing planners.

A trace is JSON lines, one request each: {"arrival_s": 0.0, "prompt_tokens": 1024, "output_tokens": 128}
("timestamp", "input_len" and "output_len" are read too); requests are sorted by arrival."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from benchmark.runner import arrival_offsets
from benchmark.sim.types import SimRequest


def load_trace(path: Path) -> list[SimRequest]:
    requests = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            arrival = raw["arrival_s"] if "arrival_s" in raw else raw["timestamp"]
            prompt = raw["prompt_tokens"] if "prompt_tokens" in raw else raw["input_len"]
            output = raw["output_tokens"] if "output_tokens" in raw else raw["output_len"]
            requests.append(SimRequest(float(arrival), int(prompt), int(output)))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{number}: not a trace line ({e!r})") from e
    if any(r.prompt_tokens < 1 or r.output_tokens < 1 for r in requests):
        raise ValueError(f"{path}: every request needs at least 1 prompt and 1 output token")
    return sorted(requests, key=lambda r: r.arrival_s)


def save_trace(requests: list[SimRequest], path: Path) -> None:
    Path(path).write_text("".join(json.dumps({"arrival_s": r.arrival_s, "prompt_tokens": r.prompt_tokens,
                                               "output_tokens": r.output_tokens}) + "\n" for r in requests))


def draw_len(base: int, range_ratio: float, rng: random.Random) -> int:
    """As benchmark/datasets.py draws the random dataset's lengths: uniform in [base(1-r), base(1+r)]."""
    if range_ratio <= 0:
        return base
    return rng.randint(max(1, int(base * (1 - range_ratio))), max(1, int(base * (1 + range_ratio))))


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    request_rate: float = math.inf, burstiness: float = 1.0, seed: int = 0) -> list[SimRequest]:
    """`tandem bench serve --dataset-name random`'s workload: lengths as its dataset draws them, arrivals as its
    runner schedules them (all at 0 for an infinite rate; pair with max_concurrency for a closed loop)."""
    rng = random.Random(seed)
    lengths = [(draw_len(input_len, range_ratio, rng), draw_len(output_len, range_ratio, rng))
               for _ in range(num_prompts)]
    offsets = arrival_offsets(num_prompts, request_rate, seed, burstiness)
    return [SimRequest(t, p, o) for t, (p, o) in zip(offsets, lengths, strict=True)]


@dataclass(frozen=True)
class DayShape:
    """A day compressed to `duration_s`: the rate follows a diurnal curve from `night_rate` (at the start and
    end) to `peak_rate` (at `peak_at` of the day), with `bursts` bursts of `burst_factor` x the rate lasting
    `burst_s` each at random times; prompts move from `short_input_len` at the start to `long_input_len` at the
    end (each drawn with `range_ratio`), outputs `output_len`."""

    duration_s: float = 3600.0
    night_rate: float = 0.5
    peak_rate: float = 5.0
    peak_at: float = 0.5  # fraction of the day
    bursts: int = 3
    burst_factor: float = 3.0
    burst_s: float = 60.0
    short_input_len: int = 256
    long_input_len: int = 2048
    output_len: int = 256
    range_ratio: float = 0.5

    def rate(self, t: float, burst_starts: list[float]) -> float:
        x = min(max(t / self.duration_s, 0.0), 1.0)
        # a raised cosine that is lowest at 0 and 1 and peaks at peak_at
        phase = x / self.peak_at if x <= self.peak_at else 1 + (x - self.peak_at) / (1 - self.peak_at)
        level = (1 - math.cos(math.pi * phase)) / 2
        rate = self.night_rate + (self.peak_rate - self.night_rate) * level
        if any(s <= t < s + self.burst_s for s in burst_starts):
            rate *= self.burst_factor
        return rate

    def input_len(self, t: float) -> int:
        x = min(max(t / self.duration_s, 0.0), 1.0)
        return max(1, round(self.short_input_len + (self.long_input_len - self.short_input_len) * x))


def day_trace(shape: DayShape, seed: int = 0) -> list[SimRequest]:
    """Arrivals of a Poisson process of the shape's rate (by thinning), each with its time of day's lengths."""
    if not 0 < shape.peak_at < 1 or shape.duration_s <= 0:
        raise ValueError("a day needs a positive duration and its peak inside it")
    rng = random.Random(seed)
    burst_starts = sorted(rng.uniform(0, max(shape.duration_s - shape.burst_s, 0.0)) for _ in range(shape.bursts))
    top = max(shape.peak_rate, shape.night_rate) * max(shape.burst_factor, 1.0)
    requests: list[SimRequest] = []
    t = 0.0
    while True:
        t += rng.expovariate(top)
        if t >= shape.duration_s:
            return requests
        if rng.random() * top <= shape.rate(t, burst_starts):
            requests.append(SimRequest(t, draw_len(shape.input_len(t), shape.range_ratio, rng),
                                       draw_len(shape.output_len, shape.range_ratio, rng)))
