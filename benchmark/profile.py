"""A node's profile: what one prefill or decode node of this model on this hardware costs, as the simulator,
`tandem plan` and the planner read it (docs/planner.md).

The engine runs steps (engine/scheduler.py): each step computes some tokens of some requests under a token
budget, running requests first, prompts chunked when longer than the budget. A step's time is modelled as linear
in four features of what it computes:

    step_s = base_s + per_token_s * T + per_seq_s * S + per_attended_s * A / 1e6

T: tokens computed (decode steps: one per request; prompt chunks: the chunk), S: requests in the step, A: the
attention pairs (query tokens x the positions each attends to; a chunk of n new tokens after c cached ones attends
n*c + n*(n+1)/2). Requests see, besides the steps, a fixed cost at the proxy and in gRPC (`request_s`: added to
every TTFT) and, when disaggregated, the handoff: P's first token to D's admission (`handoff_base_s +
handoff_per_token_s * prompt tokens`: D's read of the blocks and its admission), which delays the second token.

`tandem profile` (cluster/profile_cli.py) measures the points (`points`) and fits the coefficients (`fit`); the
points stay in the file so a fit can be checked and redone.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "tandem-profile/1"


class ProfileError(Exception):
    """A profile file that cannot be read or is not one."""


@dataclass(frozen=True)
class StepCost:
    base_s: float
    per_token_s: float
    per_seq_s: float
    per_attended_s: float  # per million attention pairs

    def seconds(self, tokens: int, seqs: int, attended: float) -> float:
        return self.base_s + self.per_token_s * tokens + self.per_seq_s * seqs + self.per_attended_s * attended / 1e6


def attended(start: int, num_new: int) -> float:
    """Attention pairs of a chunk of `num_new` query tokens after `start` computed ones (causal)."""
    return num_new * start + num_new * (num_new + 1) / 2


@dataclass(frozen=True)
class NodeSpec:
    """The node the profile measured: what the simulator's scheduler needs to batch as the engine does."""

    model: str
    dtype: str
    device: str  # "cpu" | "cuda"
    threads: int  # CPU threads per node (0: the device's default)
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    num_kv_blocks: int  # KV blocks of one node's pool (a decode node's concurrency bound)


@dataclass(frozen=True)
class PrefillPoint:
    prompt_tokens: int
    batch: int  # requests sent at once
    ttft_s: float  # median TTFT over the batch's requests, as `tandem bench serve` measures it


@dataclass(frozen=True)
class DecodePoint:
    batch: int  # requests decoding together
    context: int  # their mean context length (prompt + half the output)
    itl_s: float  # median inter-token latency


@dataclass(frozen=True)
class HandoffPoint:
    prompt_tokens: int
    seconds: float  # disaggregated minus colocated second-token time, one request alone


@dataclass(frozen=True)
class Points:
    prefill: tuple[PrefillPoint, ...] = ()
    decode: tuple[DecodePoint, ...] = ()
    handoff: tuple[HandoffPoint, ...] = ()


@dataclass(frozen=True)
class Profile:
    node: NodeSpec
    step: StepCost
    request_s: float  # fixed per-request cost in TTFT (proxy, tokenizer, gRPC)
    handoff_base_s: float
    handoff_per_token_s: float
    points: Points = field(default_factory=Points)
    hardware: str = ""  # free text: the machine measured
    cores: int = 0  # CPU cores the nodes shared when measured (the simulator's contention bound; 0: no bound)
    command: str = ""  # what produced it

    def handoff_s(self, prompt_tokens: int) -> float:
        return self.handoff_base_s + self.handoff_per_token_s * prompt_tokens

    def decode_step_s(self, batch: int, context: int) -> float:
        """One decode step of `batch` requests of mean context `context`."""
        return self.step.seconds(batch, batch, float(batch) * context)

    def prefill_s(self, prompt_tokens: int) -> float:
        """A prompt alone on an idle node, from its arrival to its first token (no queueing)."""
        return self.request_s + sum(self.step.seconds(n, 1, attended(start, n))
                                    for start, n in chunks(prompt_tokens, self.node.max_num_batched_tokens))

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **asdict(self)}

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")


def chunks(prompt_tokens: int, budget: int) -> list[tuple[int, int]]:
    """(start, n) of the steps that prefill a prompt alone under a token budget."""
    return [(start, min(budget, prompt_tokens - start)) for start in range(0, prompt_tokens, budget)]


def load_profile(path: Path) -> Profile:
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProfileError(f"{path}: not a readable profile ({e})") from e
    return profile_from_json(raw, str(path))


def profile_from_json(raw: Any, where: str = "profile") -> Profile:
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ProfileError(f"{where}: not a {FORMAT} file (its \"format\" must be {FORMAT!r})")
    try:
        points = raw.get("points") or {}
        return Profile(
            node=NodeSpec(**raw["node"]), step=StepCost(**raw["step"]), request_s=float(raw["request_s"]),
            handoff_base_s=float(raw["handoff_base_s"]), handoff_per_token_s=float(raw["handoff_per_token_s"]),
            points=Points(prefill=tuple(PrefillPoint(**p) for p in points.get("prefill", ())),
                          decode=tuple(DecodePoint(**p) for p in points.get("decode", ())),
                          handoff=tuple(HandoffPoint(**p) for p in points.get("handoff", ()))),
            hardware=str(raw.get("hardware", "")), cores=int(raw.get("cores", 0)),
            command=str(raw.get("command", "")))
    except (KeyError, TypeError, ValueError) as e:
        raise ProfileError(f"{where}: a field is missing or wrong ({e!r})") from e


def prefill_schedule(prompt_tokens: int, batch: int, budget: int, max_seqs: int) -> list[tuple[int, int, float]]:
    """The steps that prefill `batch` equal prompts arriving together, as the scheduler packs them: (tokens, seqs,
    attended) per step, the budget filled in arrival order and a prompt split across steps where it overflows."""
    return _pack(prompt_tokens, batch, budget, max_seqs)[0]


def _pack(prompt_tokens: int, batch: int, budget: int, max_seqs: int) -> tuple[list[tuple[int, int, float]], list[int]]:
    """prefill_schedule's steps, and the index of the step in which each prompt is done (in finishing order)."""
    remaining = [prompt_tokens] * batch
    done = [0] * batch
    steps: list[tuple[int, int, float]] = []
    finished_in: list[int] = []
    while any(remaining):
        budget_left, seqs, pairs = budget, 0, 0.0
        for i in range(batch):
            if not remaining[i] or budget_left == 0 or seqs == max_seqs:
                continue
            n = min(remaining[i], budget_left)
            pairs += attended(done[i], n)
            done[i] += n
            remaining[i] -= n
            budget_left -= n
            seqs += 1
            if not remaining[i]:
                finished_in.append(len(steps))
        steps.append((budget - budget_left, seqs, pairs))
    return steps, finished_in


def fit(node: NodeSpec, points: Points) -> tuple[StepCost, float, float, float]:
    """Least-squares step cost, per-request cost and handoff line from the measured points (every coefficient
    kept non-negative: a negative cost would let the simulator's steps go faster with more work).

    A prefill point's median TTFT is the request cost plus the steps up to the median request's first token; a
    decode point's ITL is one decode step. Rows are weighted by 1/target so that short and long times count
    alike (the goal is relative error)."""
    rows: list[list[float]] = []
    targets: list[float] = []
    for p in points.prefill:
        steps = prefill_schedule(p.prompt_tokens, p.batch, node.max_num_batched_tokens, node.max_num_seqs)
        upto = _median_finish_step(p.prompt_tokens, p.batch, node.max_num_batched_tokens, node.max_num_seqs)
        feats = [1.0, float(upto + 1), 0.0, 0.0, 0.0]
        for tokens, seqs, pairs in steps[:upto + 1]:
            feats[2] += tokens
            feats[3] += seqs
            feats[4] += pairs / 1e6
        rows.append(feats)
        targets.append(p.ttft_s)
    for d in points.decode:
        rows.append([0.0, 1.0, float(d.batch), float(d.batch), d.batch * d.context / 1e6])
        targets.append(d.itl_s)
    if len(rows) < 5:
        raise ProfileError(f"{len(rows)} prefill/decode points: the fit needs at least 5")
    coef = _nonnegative_lstsq(np.array(rows), np.array(targets))
    step = StepCost(base_s=coef[1], per_token_s=coef[2], per_seq_s=coef[3], per_attended_s=coef[4])
    base, per_token = _handoff_line(points.handoff)
    return step, float(coef[0]), base, per_token


def _median_finish_step(prompt_tokens: int, batch: int, budget: int, max_seqs: int) -> int:
    """Index of the step in which the median request of the batch gets its last prompt token computed."""
    finished_in = _pack(prompt_tokens, batch, budget, max_seqs)[1]
    return finished_in[(len(finished_in) - 1) // 2]


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> list[float]:
    """Weighted least squares with the coefficients clamped at 0 by refitting without those that went negative."""
    weights = 1.0 / np.maximum(b, 1e-9)
    aw, bw = a * weights[:, None], b * weights
    active = list(range(a.shape[1]))
    while True:
        sol, *_ = np.linalg.lstsq(aw[:, active], bw, rcond=None)
        negative = [active[i] for i, v in enumerate(sol) if v < 0]
        if not negative:
            coef = [0.0] * a.shape[1]
            for i, v in zip(active, sol, strict=True):
                coef[i] = float(v)
            return coef
        active = [i for i in active if i not in negative]
        if not active:
            return [0.0] * a.shape[1]


def _handoff_line(points: Sequence[HandoffPoint]) -> tuple[float, float]:
    if not points:
        return 0.0, 0.0
    if len(points) == 1:
        return max(points[0].seconds, 0.0), 0.0
    x = np.array([p.prompt_tokens for p in points], dtype=float)
    y = np.array([p.seconds for p in points], dtype=float)
    slope, intercept = np.polyfit(x, y, 1)
    if slope < 0:
        return max(float(np.mean(y)), 0.0), 0.0
    return max(float(intercept), 0.0), float(slope)


def fit_errors(profile: Profile) -> list[tuple[str, float, float]]:
    """(point, measured, fitted) for every measured prefill and decode point: how well the model fits."""
    node = profile.node
    out: list[tuple[str, float, float]] = []
    for p in profile.points.prefill:
        steps = prefill_schedule(p.prompt_tokens, p.batch, node.max_num_batched_tokens, node.max_num_seqs)
        upto = _median_finish_step(p.prompt_tokens, p.batch, node.max_num_batched_tokens, node.max_num_seqs)
        fitted = profile.request_s + sum(profile.step.seconds(t, s, a) for t, s, a in steps[:upto + 1])
        out.append((f"prefill L={p.prompt_tokens} batch={p.batch}", p.ttft_s, fitted))
    for d in profile.points.decode:
        out.append((f"decode batch={d.batch} context={d.context}", d.itl_s, profile.decode_step_s(d.batch, d.context)))
    return out


def worst_relative_error(errors: Iterable[tuple[str, float, float]]) -> float:
    return max((abs(f - m) / m for _, m, f in errors if m > 0), default=math.nan)
