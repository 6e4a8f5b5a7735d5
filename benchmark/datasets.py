"""Workloads, reproducible from a seed: lists of `SampleRequest`s (requests sent independently), or, for
multi-turn-session, lists of `Session`s (conversations whose later turns carry the server's actual replies, so
the runner builds each turn's history as the session goes; see benchmark.sessions).

Synthetic prompts are token-exact: a prompt of N tokens encodes to exactly N tokens with the benchmark's tokenizer
(without special tokens; a server whose tokenizer adds a BOS token sees N + 1).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

DATASET_NAMES = ("random", "shared-prefix", "multi-turn", "multi-turn-session", "long-prompt", "jsonl")
SESSION_DATASETS = ("multi-turn-session",)
_ALIASES = {"custom": "jsonl", "prefix_repetition": "shared-prefix"}


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class SampleRequest:
    """One request of a workload: a completion prompt, or (multi-turn) a chat history ending in a user turn.

    `prompt` is always set (the history flattened to text when `messages` is), so every dataset also runs on the
    completions endpoint. `prompt_len` is the client's token count; the server's own count (from its usage
    chunk) wins in the results when it reports one.
    """

    prompt: str
    prompt_len: int
    expected_output_len: int
    messages: tuple[ChatMessage, ...] | None = None


@dataclass(frozen=True)
class DatasetConfig:
    """What `get_samples` needs; the CLI's flags map onto it one to one."""

    name: str = "random"
    num_prompts: int = 1000
    seed: int = 0
    input_len: int | None = None  # default 1024 (random, multi-turn per turn), 4096 (long-prompt)
    output_len: int | None = None  # default 128
    range_ratio: float = 0.0  # lengths drawn uniformly from [len * (1 - r), len * (1 + r)]
    prefix_len: int = 256  # shared-prefix: tokens of each group's shared system prompt
    num_prefixes: int = 4  # shared-prefix: number of groups
    num_turns: int = 4  # multi-turn, multi-turn-session: user turns per conversation
    system_prompt_len: int = 0  # multi-turn-session: tokens of the system prompt every session shares (0: none)
    think_time_s: float = 0.0  # multi-turn-session: mean pause between a reply and the next user turn
    dataset_path: Path | None = None  # jsonl


@dataclass(frozen=True)
class SessionTurn:
    """One user turn of a session. `think_time_s` is the pause between the previous turn's reply and this turn
    (0 for a session's first turn)."""

    user_message: str
    user_len: int  # tokens of `user_message`
    expected_output_len: int
    think_time_s: float = 0.0


@dataclass(frozen=True)
class Session:
    """A conversation sent turn by turn: [system prompt], user 1, (reply 1), user 2, ... where each reply is the
    server's answer to the turn before, known only while the session runs."""

    system_prompt: str  # "" for none; the same text in every session of a workload
    system_prompt_len: int
    turns: tuple[SessionTurn, ...]


class PromptSynthesizer:
    """Random text of an exact token length, from a tokenizer's ordinary (non-special) vocabulary."""

    def __init__(self, tokenizer: Tokenizer, rng: random.Random) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        special_ids = set(tokenizer.get_added_tokens_decoder())
        candidates = [i for i in range(tokenizer.get_vocab_size()) if i not in special_ids]
        # only tokens that survive a round trip alone: a lone byte of a multi-byte character decodes to U+FFFD,
        # which encodes to other tokens, and a prompt made of such bytes never settles on a length
        texts = tokenizer.decode_batch([[i] for i in candidates], skip_special_tokens=False)
        encoded = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        self.ordinary_ids = [i for i, e in zip(candidates, encoded, strict=True) if e.ids == [i]]
        if not self.ordinary_ids:
            raise ValueError("the tokenizer has no ordinary tokens to build prompts from")

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def text(self, num_tokens: int) -> str:
        """Text that encodes to exactly `num_tokens` tokens.

        Decoding random ids and encoding the text again can merge or split tokens, so the ids are re-encoded,
        cut or topped up with fresh random ids until the round trip is stable.
        """
        if num_tokens <= 0:
            return ""
        for attempt in range(64):
            if attempt % 8 == 0:  # a fresh start now and then, in case the fix-ups cycle
                token_ids = self._random_ids(num_tokens)
            text = self.tokenizer.decode(token_ids, skip_special_tokens=False)
            encoded = self.tokenizer.encode(text, add_special_tokens=False).ids
            if len(encoded) == num_tokens:
                return text
            token_ids = encoded[:num_tokens] + self._random_ids(num_tokens - len(encoded))
        raise RuntimeError(f"could not build a prompt of exactly {num_tokens} tokens with this tokenizer")

    def _random_ids(self, n: int) -> list[int]:
        return [self.rng.choice(self.ordinary_ids) for _ in range(max(n, 0))]


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A fast tokenizer from a model directory (its tokenizer.json), a tokenizer.json file, or a GGUF file (or a
    directory holding one: the vocabulary in its metadata, as the proxy reads it; `tandem serve`'s default model
    is one). ValueError when there is none."""
    from engine.gguf_config import find_gguf_file

    path = Path(path)
    if find_gguf_file(path) is not None:
        from engine.tokenizer import load_tokenizer as load_model_tokenizer  # here: benchmark/ imports no torch

        try:
            return load_model_tokenizer(path).backend_tokenizer  # type: ignore[no-any-return]
        except (ValueError, AttributeError) as e:  # ModelConfigError is a ValueError
            raise ValueError(f"no tokenizer at {path}: {e}") from None
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"no tokenizer.json at {path} (give --tokenizer a model directory, tokenizer.json or GGUF)")
    return Tokenizer.from_file(str(file))


def prompt_synthesizer(model: Path, seed: int) -> PromptSynthesizer:
    """Random prompts of exact token lengths from a model's tokenizer (`load_tokenizer`'s sources)."""
    return PromptSynthesizer(load_tokenizer(model), random.Random(seed))


def get_samples(config: DatasetConfig, tokenizer: Tokenizer | None) -> list[SampleRequest]:
    """The workload `config` names, `config.num_prompts` requests long."""
    name = _ALIASES.get(config.name, config.name)
    if name == "jsonl":
        return _jsonl(config, tokenizer)
    if tokenizer is None:
        raise ValueError(f"the {name!r} dataset needs a tokenizer (--tokenizer)")
    rng = random.Random(config.seed)
    synth = PromptSynthesizer(tokenizer, rng)
    if name == "random":
        return _random(config, synth, rng, default_input_len=1024)
    if name == "long-prompt":
        return _random(config, synth, rng, default_input_len=4096)
    if name == "shared-prefix":
        return _shared_prefix(config, synth, rng)
    if name == "multi-turn":
        return _multi_turn(config, synth, rng)
    if name in SESSION_DATASETS:
        raise ValueError(f"the {name!r} dataset is a list of sessions (get_sessions), not of requests")
    raise ValueError(f"unknown dataset {config.name!r}; expected one of {', '.join(DATASET_NAMES)}")


def _draw_len(base: int, range_ratio: float, rng: random.Random) -> int:
    if range_ratio <= 0:
        return base
    low, high = max(1, int(base * (1 - range_ratio))), max(1, int(base * (1 + range_ratio)))
    return rng.randint(low, high)


def _output_len(config: DatasetConfig, rng: random.Random) -> int:
    return _draw_len(config.output_len or 128, config.range_ratio, rng)


def _random(config: DatasetConfig, synth: PromptSynthesizer, rng: random.Random,
            default_input_len: int) -> list[SampleRequest]:
    samples = []
    for _ in range(config.num_prompts):
        input_len = _draw_len(config.input_len or default_input_len, config.range_ratio, rng)
        samples.append(SampleRequest(synth.text(input_len), input_len, _output_len(config, rng)))
    return samples


def _shared_prefix(config: DatasetConfig, synth: PromptSynthesizer, rng: random.Random) -> list[SampleRequest]:
    """`num_prefixes` groups; each prompt is its group's prefix followed by its own random suffix.

    Prefix and suffix are built separately, so their sum is counted again on the joined text (a merge across the
    seam can change it by a token): `prompt_len` is the joined prompt's true length.
    """
    if config.num_prefixes <= 0:
        raise ValueError("--shared-prefix-num-prefixes must be positive")
    prefixes = [synth.text(config.prefix_len) for _ in range(config.num_prefixes)]
    samples = []
    for i in range(config.num_prompts):
        suffix = synth.text(_draw_len(config.input_len or 128, config.range_ratio, rng))
        prompt = prefixes[i % config.num_prefixes] + suffix
        samples.append(SampleRequest(prompt, synth.count(prompt), _output_len(config, rng)))
    return samples


def _multi_turn(config: DatasetConfig, synth: PromptSynthesizer, rng: random.Random) -> list[SampleRequest]:
    """Conversations of `num_turns` user turns; request k of a conversation carries turns 1..k with synthetic
    assistant replies (of the output length) in between, so each request's history is the previous one's plus a
    reply and a new user turn. Requests are listed turn-major, so a conversation's turns are spread in time."""
    if config.num_turns <= 0:
        raise ValueError("--multi-turn-num-turns must be positive")
    num_conversations = -(-config.num_prompts // config.num_turns)
    conversations: list[list[SampleRequest]] = []
    for _ in range(num_conversations):
        history: list[ChatMessage] = []
        turns = []
        for _turn in range(config.num_turns):
            user = synth.text(_draw_len(config.input_len or 128, config.range_ratio, rng))
            history.append(ChatMessage("user", user))
            output_len = _output_len(config, rng)
            prompt = "".join(m.content for m in history)
            turns.append(SampleRequest(prompt, synth.count(prompt), output_len, tuple(history)))
            history.append(ChatMessage("assistant", synth.text(output_len)))
        conversations.append(turns)
    ordered = [conv[turn] for turn in range(config.num_turns) for conv in conversations]
    return ordered[: config.num_prompts]


def get_sessions(config: DatasetConfig, tokenizer: Tokenizer | None) -> list[Session]:
    """multi-turn-session: ceil(num_prompts / num_turns) sessions of `num_turns` user turns, `num_prompts` turns
    in all (when they don't divide, the last turn of the last sessions is left out, as multi-turn lists them).

    Every session starts with the same system prompt (`system_prompt_len` tokens; none for 0). User turns have
    the input length, replies are asked for with the output length (both spread by `range_ratio`); each turn
    after the first waits a think time drawn uniformly from [t * (1 - r), t * (1 + r)] for t = `think_time_s`
    and r = `range_ratio` (so fixed for r = 0), drawn here from the seed, so a run's pauses are reproducible.
    """
    name = _ALIASES.get(config.name, config.name)
    if name not in SESSION_DATASETS:
        raise ValueError(f"the {config.name!r} dataset is a list of requests (get_samples), not of sessions")
    if tokenizer is None:
        raise ValueError(f"the {name!r} dataset needs a tokenizer (--tokenizer)")
    if config.num_turns <= 0:
        raise ValueError("--multi-turn-num-turns must be positive")
    if config.system_prompt_len < 0:
        raise ValueError("--multi-turn-system-prompt-len must not be negative")
    if config.think_time_s < 0:
        raise ValueError("--multi-turn-think-time must not be negative")
    rng = random.Random(config.seed)
    synth = PromptSynthesizer(tokenizer, rng)
    system_prompt = synth.text(config.system_prompt_len)
    num_sessions = -(-config.num_prompts // config.num_turns)
    sessions = []
    for index in range(num_sessions):
        # turn-major numbering (turn t of session i is request t * num_sessions + i) decides who loses a turn
        num_turns = sum(t * num_sessions + index < config.num_prompts for t in range(config.num_turns))
        turns = []
        for number in range(num_turns):
            user_len = _draw_len(config.input_len or 128, config.range_ratio, rng)
            think_time_s = _draw_think_time(config, rng) if number > 0 else 0.0
            turns.append(SessionTurn(synth.text(user_len), user_len, _output_len(config, rng), think_time_s))
        sessions.append(Session(system_prompt, config.system_prompt_len, tuple(turns)))
    return sessions


def _draw_think_time(config: DatasetConfig, rng: random.Random) -> float:
    if config.think_time_s <= 0 or config.range_ratio <= 0:
        return config.think_time_s
    return rng.uniform(config.think_time_s * max(0.0, 1 - config.range_ratio),
                       config.think_time_s * (1 + config.range_ratio))


def _jsonl(config: DatasetConfig, tokenizer: Tokenizer | None) -> list[SampleRequest]:
    """One JSON object a line: {"prompt": "..."} or {"messages": [{"role", "content"}, ...]}, and optionally
    "output_len" (else --random-output-len, else 128). Lines are reused in order when num_prompts is larger."""
    if config.dataset_path is None:
        raise ValueError("the jsonl dataset needs --dataset-path FILE")
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(config.dataset_path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{config.dataset_path}:{number}: not JSON ({e})") from None
        if not isinstance(row, dict) or not ("prompt" in row or "messages" in row):
            raise ValueError(f"{config.dataset_path}:{number}: expected an object with 'prompt' or 'messages'")
        rows.append(row)
    if not rows:
        raise ValueError(f"{config.dataset_path} has no prompts")
    samples = []
    for i in range(config.num_prompts):
        row = rows[i % len(rows)]
        messages = None
        if "messages" in row:
            messages = tuple(ChatMessage(str(m["role"]), str(m["content"])) for m in row["messages"])
            prompt = "".join(m.content for m in messages)
        else:
            prompt = str(row["prompt"])
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False).ids) if tokenizer else 0
        output_len = int(row.get("output_len") or config.output_len or 128)
        samples.append(SampleRequest(prompt, prompt_len, output_len, messages))
    return samples
