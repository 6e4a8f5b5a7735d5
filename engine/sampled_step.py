"""A launched step's sampled tokens on their way to the host (asynchronous scheduling, engine/llm_engine.py).

When a step is launched, its sampled ids and logprobs are copied to pinned host memory without blocking and
an event marks the end of the copies; the host waits for that event only when it reads them, one step later,
while the device runs the next step. The device tensor of sampled ids stays, for the next step's input ids
(engine/runner.py): a decode row's input never goes through the host.
"""

from __future__ import annotations

import torch

from engine.prompt_logprobs import PromptLogprobsStep
from engine.sampler import LogprobTensors, SampledToken, SamplerOutput, sampled_tokens
from engine.types import PositionLogprobs


def _copy_to_host(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    # the caching host allocator keeps the pinned block until this copy is done, even if `host` is dropped
    return host.copy_(tensor, non_blocking=True)


class SampledStep:
    """The samples of one launched step: `device_token_ids` for the next step's inputs, `tokens()` for the
    host, which waits for the device only there."""

    def __init__(self, request_ids: list[str], out: SamplerOutput, prompt: PromptLogprobsStep | None = None
                 ) -> None:
        """request_ids: each row's request, in row order (a request with drafts has consecutive rows); prompt: the
        step's prompt logprobs, if any request asked (engine/prompt_logprobs.py)."""
        self.request_ids = request_ids
        # a request's last row: the sample the next step may take as input (asynchronous scheduling has no drafts)
        self.row_of = {request_id: row for row, request_id in enumerate(request_ids)}
        self.device_token_ids = out.token_ids  # [num_rows] long, where the step ran
        self._host_token_ids = out.token_ids
        self._host_logprobs: LogprobTensors | None = out.logprobs
        self._ready: torch.cuda.Event | None = None
        if out.token_ids.device.type == "cuda":
            if request_ids:
                self._host_token_ids = _copy_to_host(out.token_ids)
            if out.logprobs is not None:
                self._host_logprobs = out.logprobs.with_tensors([_copy_to_host(t) for t in out.logprobs.tensors()])
            if prompt is not None:
                prompt = PromptLogprobsStep(prompt.plan, prompt.tensors.with_tensors(
                    [_copy_to_host(t) for t in prompt.tensors.tensors()]))
            # recorded even when nothing sampled: wait() also says the step's K/V is written
            self._ready = torch.cuda.Event()
            self._ready.record()
        self._prompt = prompt

    @classmethod
    def empty(cls, device: torch.device, prompt: PromptLogprobsStep | None = None) -> SampledStep:
        """A step that sampled nothing (every row a prefill chunk short of its prompt's end)."""
        return cls([], SamplerOutput(torch.empty(0, dtype=torch.long, device=device), None), prompt)

    def wait(self) -> None:
        """Blocks until the step has run on the device (its K/V written, its samples copied)."""
        if self._ready is not None:
            self._ready.synchronize()

    def tokens(self) -> dict[str, list[SampledToken]]:
        """The sampled tokens of each request that sampled, by request id, in row order: one, or one per position
        of its drafts (waits for the step)."""
        if not self.request_ids:
            return {}
        self.wait()
        tokens: dict[str, list[SampledToken]] = {}
        for request_id, token in zip(self.request_ids, sampled_tokens(self._host_token_ids.tolist(),
                                                                        self._host_logprobs), strict=True):
            tokens.setdefault(request_id, []).append(token)
        return tokens

    def prompt_logprobs(self) -> dict[str, tuple[int, list[PositionLogprobs]]]:
        """The prompt logprobs the step computed: request id -> (first position, those of the positions from
        there) (waits for the step when there are any)."""
        if self._prompt is None:
            return {}
        self.wait()
        return self._prompt.by_request()
