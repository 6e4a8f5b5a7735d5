"""vLLM's prompt logprobs (`SamplingParams.prompt_logprobs`): for each prompt position after the first, the logprob
of the prompt token given the tokens before it, its rank and the top-N, from the raw logits (no penalty, bias or
grammar touches them, as with vLLM's default `raw_logprobs`).

They are computed by the steps that prefill the prompt, chunk by chunk, and only for the requests that ask: the
runner takes logits at those requests' prompt rows besides the sampling rows. The row of prompt position p gives
the logprobs of position p + 1; the last prompt row's logits give the first output token, not a prompt logprob:

    prompt:      t0    t1    t2    t3   | first output token
    row of:      p0    p1    p2    p3
    logprobs of: t1    t2    t3    (the sample)

Positions that come from the prefix cache have no logits, so a request still short of its prompt logprobs takes
no prefix-cache hits (engine/scheduler.py), as in vLLM. The request collects them (Request.add_prompt_logprobs)
and hands them out with its first output; a chunk recomputed after a preemption adds nothing twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from engine.sampler import LogprobTensors, logprob_dicts, to_device, token_logprobs
from engine.types import PositionLogprobs

if TYPE_CHECKING:
    from engine.scheduler import ScheduledRequest

# The float32 log-softmax of a slice of rows stays under this: a long prefill chunk's rows times a vocabulary of
# 150k would otherwise take gigabytes at once, outside what the GPU memory plan profiled (engine/device.py).
_SLICE_BYTES = 64 << 20


class LogitsModel(Protocol):
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass
class PromptLogprobsPlan:
    """A step's prompt-logprob rows. Request i gets positions [first_positions[i], first_positions[i] + counts[i]);
    `rows` are the step's input rows whose logits give them, in that order, with each row's next prompt token
    (`target_ids`) and N (`num_top`)."""

    request_ids: list[str] = field(default_factory=list)
    first_positions: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    target_ids: list[int] = field(default_factory=list)
    num_top: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, items: Sequence[ScheduledRequest]) -> PromptLogprobsPlan:
        """The rows of a step of `items`, in the runner's row order (each item's tokens one after the other)."""
        plan = cls()
        first_row = 0
        for item in items:
            request = item.request
            recorded = request.prompt_logprobs  # [None, position 1, ...]; None: not asked, or handed out
            num_top = request.params.prompt_logprobs
            if recorded is not None and num_top is not None:
                # rows [start, stop): their next position is a prompt position not recorded yet
                start = max(item.start, len(recorded) - 1)
                stop = min(item.start + item.num_new_tokens, request.num_prompt_tokens - 1)
                if start < stop:
                    plan.request_ids.append(request.request_id)
                    plan.first_positions.append(start + 1)
                    plan.counts.append(stop - start)
                    plan.rows.extend(range(first_row + start - item.start, first_row + stop - item.start))
                    plan.target_ids.extend(request.token_ids[start + 1:stop + 1])
                    plan.num_top.extend([num_top] * (stop - start))
            first_row += item.num_new_tokens
        return plan


def logits_slices(num_rows: int, vocab_size: int) -> list[slice]:
    """How the prompt rows' logits are taken, a slice at a time. Every tensor-parallel rank takes the same slices:
    each is one all-gather of the logits (engine/model/llama.py)."""
    step = max(1, _SLICE_BYTES // (4 * vocab_size))
    return [slice(begin, min(begin + step, num_rows)) for begin in range(0, num_rows, step)]


def compute_prompt_logprobs(model: LogitsModel, hidden: torch.Tensor, plan: PromptLogprobsPlan, vocab_size: int
            ) -> PromptLogprobsStep:
    """Launches the plan's logprobs on the device (nothing read back). hidden: [step rows, hidden size]."""
    rows = to_device(plan.rows, torch.long, hidden.device)
    targets = to_device(plan.target_ids, torch.long, hidden.device)
    max_n = min(max(plan.num_top), vocab_size)
    parts = []
    for part in logits_slices(len(plan.rows), vocab_size):
        logprobs = model.compute_logits(hidden[rows[part]]).to(torch.float32).log_softmax(dim=-1)
        parts.append(token_logprobs(logprobs, targets[part], max_n))
    chosen_logprobs, chosen_ranks, top_logprobs, top_ids = (torch.cat(column) for column in zip(*parts, strict=True))
    tensors = LogprobTensors(list(range(len(plan.rows))), plan.num_top, targets, chosen_logprobs, chosen_ranks,
                             top_logprobs, top_ids)
    return PromptLogprobsStep(plan, tensors)


def take_prompt_logits(model: LogitsModel, hidden: torch.Tensor, rows: list[int], vocab_size: int) -> None:
    """A tensor-parallel worker's part in compute_prompt_logprobs: the same logits, whose all-gathers pair with rank
    0's."""
    rows_device = to_device(rows, torch.long, hidden.device)
    for part in logits_slices(len(rows), vocab_size):
        model.compute_logits(hidden[rows_device[part]])


@dataclass
class PromptLogprobsStep:
    """A launched step's prompt logprobs: on the device until their tensors are replaced by host copies."""

    plan: PromptLogprobsPlan
    tensors: LogprobTensors

    def by_request(self) -> dict[str, tuple[int, list[PositionLogprobs]]]:
        """Request id -> (its first position here, the logprobs of its positions from there), read from the
        tensors (which must be on the host, or are read back here)."""
        positions = logprob_dicts(self.tensors)
        result = {}
        row = 0
        for request_id, first, count in zip(self.plan.request_ids, self.plan.first_positions, self.plan.counts,
                                            strict=True):
            result[request_id] = (first, [positions[i] for i in range(row, row + count)])
            row += count
        return result
