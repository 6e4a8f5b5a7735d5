"""Structured output with xgrammar: a request's `structured_outputs` (engine/types.py) becomes a grammar whose
matcher says, before each token, which tokens may come next.

- `StructuredOutputCompiler` compiles a constraint once per key (LRU cache, failures cached too) against the
  model's tokenizer: xgrammar's TokenizerInfo is built from the tokenizer engine/tokenizer.py loads (the nodes
  skip loading one for themselves, so it is loaded on the first structured request) with the model's
  vocabulary size (the logits' width, which may exceed the tokenizer's) and the model's EOS ids as stop tokens.
- `Grammar` is one request's matcher. The engine advances it by every token the request appends (a decode node
  first by the token the prefill node sampled: engine/request.py), so a request handed from P to D follows
  the grammar D would have followed alone.
- A structural tag (free text, with JSON values after its triggers) becomes xgrammar's `triggered_tags` format;
  each structure's schema is compiled to EBNF first, so that it honours disable_any_whitespace and
  disable_additional_properties as a `json` constraint does (xgrammar's own `json_schema` format takes
  neither, and vLLM passes neither for a structural tag).
- `fill_token_bitmask` writes one packed row per constrained request (bit t of the row allows token t) on the
  CPU; the runner does it after launching the step's forward pass, while the device computes, and the sampler
  masks the logits with it (engine/sampler.py). An EOS id is allowed only where the grammar may end; once it
  has ended (`is_terminated`), the request finishes (engine/request.py).

xgrammar imports torch and transformers: it is imported here only when the first constrained request comes.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from engine.types import StructuredOutputsParams, check_structural_tag

logger = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept (a compiled grammar of a big vocabulary takes about 1 MB)


def bitmask_width(vocab_size: int) -> int:
    """32-bit words per bitmask row."""
    return -(-vocab_size // 32)


class Grammar:
    """One request's grammar matcher. Not thread-safe: the engine thread owns it."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advances past `token_id`; False (the state unchanged) when the grammar does not allow it."""
        return bool(self._matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The grammar has accepted its end (an EOS token): nothing may follow."""
        return bool(self._matcher.is_terminated())

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into bitmask[row] (int32 on the CPU). A terminated matcher allows
        everything: such a request is finishing, and whatever it samples is discarded."""
        if self.is_terminated:
            bitmask[row].fill_(-1)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def allows(self, token_id: int, vocab_size: int) -> bool:
        """Whether `token_id` may come next (the state unchanged)."""
        if not 0 <= token_id < vocab_size or self.is_terminated:
            return False
        bitmask = torch.zeros(1, bitmask_width(vocab_size), dtype=torch.int32)
        self._matcher.fill_next_token_bitmask(bitmask, 0)
        return bool((int(bitmask[0, token_id // 32]) >> (token_id % 32)) & 1)


def fill_token_bitmask(grammars: Sequence[Grammar], vocab_size: int) -> torch.Tensor:
    """The packed masks of `grammars`, one row each: [len(grammars), ceil(vocab_size / 32)] int32 on the CPU
    (pinned where a GPU will read it), for engine.sampler.apply_token_bitmask."""
    bitmask = torch.empty(len(grammars), bitmask_width(vocab_size), dtype=torch.int32,
                          pin_memory=torch.cuda.is_available())
    for row, grammar in enumerate(grammars):
        grammar.fill_bitmask(bitmask, row)
    return bitmask


def choice_grammar(choices: Iterable[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


# what a JSON string may hold unescaped, as code point ranges (no control characters, no surrogates); the
# astral range as characters: xgrammar's regex has no escape beyond \\uFFFF. Without '"' (U+0022) and '\\'
# (U+005C): the pattern's characters go into the JSON string as they are, so an unescaped quote there would end
# the string early and the rest of the "string" would be JSON the schema never allowed (seen with SmolLM2)
_JSON_STRING_CHARACTERS = "\\u0020-\\u0021\\u0023-\\u005b\\u005d-\\ud7ff\\ue000-\\uffff\U00010000-\U0010ffff"
# keywords whose values are JSON data, not schemas: left as they are
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


def bounded_strings_as_patterns(schema: Any) -> Any:
    """`schema` with each string bounded by minLength/maxLength (and no pattern) bounded by a pattern instead.

    xgrammar 0.2.9 compiles a length-bounded string to a bare character class that admits raw control characters
    (U+0000-U+001F but CR and LF), which JSON forbids: strict parsers refuse such output (xgrammar issue #800,
    open). Its pattern path builds JSON-string-aware rules instead. The class is spelled as code point ranges:
    xgrammar then admits only well-formed UTF-8 (with `.` or `[\\s\\S]` it lets a byte-level model write overlong
    sequences and surrogates, which decode to U+FFFD, several per character). Neither path can write an escape
    (\\", \\n) in a bounded string."""
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in _DATA_KEYWORDS else bounded_strings_as_patterns(value) for key, value in schema.items()}
    kinds = out.get("type")
    is_string = kinds == "string" or (isinstance(kinds, list) and "string" in kinds)
    if is_string and "pattern" not in out and ("minLength" in out or "maxLength" in out):
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^[{_JSON_STRING_CHARACTERS}]{{{low},{high}}}$"
    return out


def structural_tag_format(spec: StructuredOutputsParams) -> dict[str, Any]:
    """spec.structural_tag (vLLM's legacy shape: structures and triggers) in xgrammar's structural-tag format: a
    `triggered_tags` format whose tags hold each structure's schema as an EBNF grammar, compiled with the spec's
    whitespace and additional-properties options. ValueError with xgrammar's reason for a schema it refuses."""
    import xgrammar as xgr

    assert spec.structural_tag is not None, "not a structural tag"
    tag = check_structural_tag(spec.structural_tag)
    if "format" in tag:  # already xgrammar's format: its json_schema parts take xgrammar's whitespace defaults
        return tag
    tags = []
    for structure in tag["structures"]:
        schema = json.dumps(bounded_strings_as_patterns(structure["schema"]))
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=not spec.disable_any_whitespace,
                                               strict_mode=spec.disable_additional_properties)
        tags.append({"type": "tag", "begin": structure["begin"], "end": structure["end"],
                     "content": {"type": "grammar", "grammar": str(grammar)}})
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": tag["triggers"], "tags": tags}}


class StructuredOutputCompiler:
    """Compiles constraints into xgrammar grammars for one model's vocabulary, caching them by key.

    Thread-safe: a node compiles on a worker thread (engine/async_engine.py) so that the engine thread, which
    makes the request's matcher next, finds the grammar compiled instead of stalling every running request."""

    def __init__(self, model_path: Path, vocab_size: int, eos_token_ids: Iterable[int], tokenizer: Any = None,
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.cache_size = cache_size
        self._tokenizer = tokenizer
        self._compiler: Any = None
        self._cache: OrderedDict[tuple[Any, ...], Any] = OrderedDict()  # key -> CompiledGrammar or ValueError
        self._lock = threading.Lock()
        self.num_compiled = 0  # compilations run (cache misses), for tests and logs

    def grammar(self, spec: StructuredOutputsParams) -> Grammar:
        """A fresh matcher for `spec`. ValueError with xgrammar's reason when it does not compile."""
        import xgrammar as xgr

        return Grammar(xgr.GrammarMatcher(self.compile(spec)))

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of `spec` (xgrammar.CompiledGrammar), from the cache when compiled before."""
        key = spec.key()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
        if cached is None:
            # compiled outside the lock: a long compile does not hold up cache hits of other requests (two threads
            # compiling one new key both get a correct grammar; the second one is kept)
            cached = self._compile(spec)
            with self._lock:
                self._cache[key] = cached
                self.num_compiled += 1
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        if isinstance(cached, ValueError):
            raise cached
        return cached

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        compiler = self._xgrammar_compiler()
        whitespace = {"any_whitespace": not spec.disable_any_whitespace}
        try:
            if spec.json is not None:
                schema = json.dumps(bounded_strings_as_patterns(json.loads(spec.json_text or "")))
                return compiler.compile_json_schema(schema, strict_mode=spec.disable_additional_properties,
                                                    **whitespace)
            if spec.json_object:
                return compiler.compile_json_schema('{"type": "object"}', **whitespace)
            if spec.regex is not None:
                return compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                return compiler.compile_grammar(choice_grammar(spec.choice))
            if spec.structural_tag is not None:
                return compiler.compile_structural_tag(json.dumps(structural_tag_format(spec)))
            assert spec.grammar is not None, f"unknown structured output kind {spec.kind}"
            return compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            # xgrammar's reasons start with a C++ source location: the client needs only the message after it
            reason = str(e).strip().splitlines()[0].split(": ", 1)[-1] if str(e).strip() else type(e).__name__
            return ValueError(f"structured_outputs.{spec.kind} does not compile: {reason}")

    def _xgrammar_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                self._compiler = self._make_compiler()
            return self._compiler

    def _make_compiler(self) -> Any:
        import xgrammar as xgr

        from engine.tokenizer import load_tokenizer

        tokenizer = self._tokenizer if self._tokenizer is not None else load_tokenizer(self.model_path)
        stop_token_ids = self.eos_token_ids or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None
                                                else [])
        if not stop_token_ids:
            raise ValueError("structured output needs an end-of-sequence token; the model names none")
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop_token_ids)
        logger.info("structured output: xgrammar with a %s vocabulary of %d tokens", info.vocab_type.name,
                    info.vocab_size)
        # a few threads: the node shares its cores with the engine thread
        return xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
