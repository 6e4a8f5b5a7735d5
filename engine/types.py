"""The vocabulary shared by the engine, the nodes and the proxy.

Torch-free on purpose: the proxy validates sampling parameters and builds outputs without importing torch.
Names follow vLLM's so its users feel at home.
"""

from __future__ import annotations

import enum
import json as json_module
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context reached
    ABORT = "abort"

    def __str__(self) -> str:
        return self.value


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's `structured_outputs`): exactly one of a JSON schema
    (`json`, an object or its JSON text), a regular expression, a list of literal choices, an EBNF grammar
    (xgrammar's dialect), any JSON object (`json_object`) or a structural tag (`structural_tag`, JSON text:
    free text in which each trigger starts a tagged JSON value; `check_structural_tag`). Checked here for shape
    only: whether xgrammar can compile it is known where it is compiled (engine/structured_output.py), which
    raises ValueError too.

    `disable_any_whitespace`: JSON without whitespace beyond ", " and ": " (otherwise any whitespace may go
    between tokens, which a weak model can fill forever). `disable_additional_properties`: objects admit no
    property their schema does not name (what OpenAI's `strict` means). Both apply to a `json` schema, to
    `json_object` (the whitespace one) and to each schema of a structural tag."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None  # kept as a tuple
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple):
                raise ValueError("structured_outputs.choice must be a list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(_CONSTRAINTS)}; "
                             f"got {', '.join(given) or 'none'}")
        if isinstance(self.json, str):
            try:
                schema = json_module.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError("structured_outputs.json must be a JSON schema object")
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(self.json).__name__}")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.structural_tag is not None:
            check_structural_tag(self.structural_tag)
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        for name in ("json_object", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a boolean")

    @property
    def kind(self) -> str:
        """Which constraint it is: json, regex, choice, grammar, json_object or structural_tag."""
        return next(name for name in _CONSTRAINTS if getattr(self, name) not in (None, False))

    @property
    def json_text(self) -> str | None:
        """The JSON schema as text (property order kept: it is the order the output follows)."""
        return self.json if isinstance(self.json, str) or self.json is None else json_module.dumps(self.json)

    def key(self) -> tuple[Any, ...]:
        """What identifies the compiled grammar (engine/structured_output.py caches by it)."""
        return (self.kind, self.json_text, self.regex, self.choice, self.grammar, self.structural_tag,
                self.disable_any_whitespace, self.disable_additional_properties)


def check_structural_tag(text: str) -> dict[str, Any]:
    """The parsed structural tag (vLLM's `structured_outputs.structural_tag`: xgrammar's legacy format, or its
    newer {"type": "structural_tag", "format": {...}}), or ValueError naming what is wrong with its shape:

        {"type": "structural_tag", "triggers": ["<tool_call>"],
         "structures": [{"begin": "<tool_call>{\"name\": \"f\", \"arguments\": ", "schema": {...},
                         "end": "}</tool_call>"}]}

    Output is free text until it writes a trigger; from there it must be one of the structures whose `begin`
    starts with that trigger (begin, a JSON value valid against `schema`, end), then it is free again. A trigger
    that begins no structure would leave the output stuck after it, so it is refused here."""
    where = "structured_outputs.structural_tag"
    try:
        tag = json_module.loads(text)
    except ValueError as e:
        raise ValueError(f"{where} is not valid JSON: {e}") from None
    if not isinstance(tag, dict) or tag.get("type") != "structural_tag":
        raise ValueError(f'{where} must be a JSON object with "type": "structural_tag"')
    if "format" in tag:  # xgrammar's own format (or, sequence, triggered_tags, ...): xgrammar checks it as it compiles
        if not isinstance(tag["format"], dict):
            raise ValueError(f"{where}.format must be an object")
        return tag
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ValueError(f"{where}.structures must be a non-empty list")
    for i, structure in enumerate(structures):
        if not isinstance(structure, dict):
            raise ValueError(f"{where}.structures[{i}] must be an object with begin, schema and end")
        for name in ("begin", "end"):
            if not isinstance(structure.get(name), str):
                raise ValueError(f"{where}.structures[{i}].{name} must be a string")
        if not structure["begin"]:
            raise ValueError(f"{where}.structures[{i}].begin must be non-empty")
        if not isinstance(structure.get("schema"), dict):
            raise ValueError(f"{where}.structures[{i}].schema must be a JSON schema object")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError(f"{where}.triggers must be a non-empty list of non-empty strings")
    for trigger in triggers:
        if not any(structure["begin"].startswith(trigger) for structure in structures):
            raise ValueError(f"{where}.triggers: {trigger!r} begins no structure (a trigger must be a prefix of "
                             "some structure's begin)")
    return tag


@dataclass
class SamplingParams:
    """How to sample one request. Validated on construction: bad values raise ValueError with the field name."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs of each sampled position, plus the sampled token's
    # top-N logprobs of each prompt position after the first, plus the prompt token's own (vLLM's meaning);
    # computed where the prompt is prefilled, which then takes no prefix-cache hits for it (they have no logits)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow
    # token id -> a bias added to its logit before sampling (OpenAI's logit_bias: in [-100, 100]); token ids
    # past the model's vocabulary are refused by the engine, which knows it. An empty dict is kept as None.
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        if self.logit_bias is not None:
            # one shape whatever the caller passed (ints as biases, an empty dict): params compare equal after
            # a trip over gRPC, whose map has no "unset"
            self.logit_bias = {token_id: float(bias) for token_id, bias in self.logit_bias.items()} or None

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        # NaN passes every comparison below unnoticed, and an infinite temperature or penalty turns logits into NaN
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise bad(name, "must be a finite number")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be -1, 0 (disabled) or a positive integer")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise bad(name, "must be an integer >= 0")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        assert isinstance(self.stop, list)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        assert isinstance(self.stop_token_ids, list)
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")
        if self.logit_bias is not None:
            _check_logit_bias(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def for_sample(self, index: int) -> SamplingParams:
        """Parameters of the index-th of n samples: n=1 each, seeds spread so samples differ yet reproduce."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)


LOGIT_BIAS_LIMIT = 100.0  # OpenAI's bound on each bias


def _check_logit_bias(logit_bias: object) -> None:
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must map token ids to biases, got {type(logit_bias).__name__}")
    for token_id, bias in logit_bias.items():
        # bool is an int to Python, never a token id or a bias to a client
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise ValueError(f"logit_bias token ids must be non-negative integers, got {token_id!r}")
        if (isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias)
                or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT):
            raise ValueError(f"logit_bias of token {token_id} must be a number in [-100, 100], got {bias!r}")


def logit_bias_from_json(value: object) -> dict[int, float] | None:
    """OpenAI's `logit_bias` as a JSON request holds it (token ids as decimal strings) in SamplingParams' shape:
    integer keys. ValueError naming logit_bias for a key that is not an integer; the biases are checked by
    SamplingParams."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be an object mapping token ids to biases, got {type(value).__name__}")
    logit_bias: dict[int, float] = {}
    for key, bias in value.items():
        # ASCII digits only: int() also takes "1_0", " 1" and other scripts' digits, which are no token ids
        if isinstance(key, str) and key.isascii() and key.isdigit():
            logit_bias[int(key)] = bias
        elif isinstance(key, int) and not isinstance(key, bool):
            logit_bias[key] = bias
        else:
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
    return logit_bias


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One dict per generated position: token id -> Logprob. Holds the sampled token and the top-N.
PositionLogprobs = dict[int, Logprob]
# A prompt's logprobs, as vLLM returns them: None for position 0 (nothing precedes it), then one dict per
# position holding the prompt token and the top-N.
PromptLogprobs = list[PositionLogprobs | None]


@dataclass(frozen=True)
class StepOutput:
    """The token one engine step appended to one request, and whether it finished the request.

    Token-level only: EOS, a stop token id, max_tokens or the context. Text (detokenization, stop strings)
    is the output processor's job (engine/output_processor.py), in the offline LLM and in the proxy."""

    request_id: str
    token_id: int
    logprobs: PositionLogprobs | None  # when asked for; decoded_token left None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id that finished it (None for EOS)
    # on a request's first output only, when params.prompt_logprobs asked (decoded_token left None)
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: PromptLogprobs | None = None  # when params.prompt_logprobs asked

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)
