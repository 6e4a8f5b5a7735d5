"""Incremental detokenization of one sequence: text grows token by token.

Torch-free, under engine/output_processor.py (which decides stop strings and what text is shown).

Each step decodes only a small window of token ids (the prefix_offset/read_offset technique of vLLM and TGI):

    token ids:  (dropped) | prefix_offset ........ read_offset ............ end
                            text already emitted   text held back + the new token

The new text is decode(window) minus decode(window without the unemitted tokens). The window starts a few
tokens into the prompt so that the first output token decodes as it does in context: SentencePiece drops the
leading space of a sequence's first piece, and byte-level BPE may need the previous bytes. While decoding
ends in U+FFFD the last bytes are an unfinished character; they are held back until a later token finishes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Prompt tokens that seed the window; vLLM uses 5 too.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"
# SentencePiece's word-boundary marker in raw vocabulary pieces.
_SENTENCEPIECE_SPACE = "\u2581"


class TokenizerLike(Protocol):
    """What the detokenizer needs of a tokenizer; a transformers tokenizer fits."""

    def decode(self, token_ids: list[int], /, skip_special_tokens: bool = False) -> str | list[str]: ...

    def convert_ids_to_tokens(self, ids: int, /) -> str | list[str] | None: ...


def _decode(tokenizer: TokenizerLike, token_ids: list[int], skip_special_tokens: bool) -> str:
    text = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    assert isinstance(text, str), f"decode of a flat id list returned {type(text).__name__}"
    return text


def decode_token(tokenizer: TokenizerLike, token_id: int) -> str:
    """The text of one token on its own, for Logprob.decoded_token.

    Like vLLM: special tokens show, a partial character shows as U+FFFD, and the leading spaces that
    SentencePiece's decode strips from a lone piece are put back from the raw piece.
    """
    text = _decode(tokenizer, [token_id], skip_special_tokens=False)
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        num_markers = len(piece) - len(piece.lstrip(_SENTENCEPIECE_SPACE))
        missing = num_markers - (len(text) - len(text.lstrip(" ")))
        if missing > 0:
            text = " " * missing + text
    return text


class IncrementalDetokenizer:
    """Text of one output sequence, pushed a token at a time; flush() releases a character still held back
    once the sequence ends. Which tokens to push (not an EOS whose text is left out) is the caller's choice."""

    def __init__(self, tokenizer: TokenizerLike, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # The decode window. Invariant: _window_ids[:_read_offset] decode to text already accounted for
        # (emitted, or prompt context); _window_ids[_read_offset:] are pushed tokens whose text is held back.
        # The window starts at the prefix offset: older ids are dropped, so it stays a few tokens long.
        self._window_ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._read_offset = len(self._window_ids)
        self._text = ""

    @property
    def text(self) -> str:
        """The output text so far."""
        return self._text

    def push(self, token_id: int) -> str:
        """Appends one output token and returns the text it adds: "" while it leaves a character unfinished."""
        self._window_ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Emits the text held back at the end of a finished sequence (an unfinished character shows as
        U+FFFD). Returns what it added."""
        if self._read_offset == len(self._window_ids):
            return ""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix_text = _decode(self._tokenizer, self._window_ids[: self._read_offset], self._skip_special_tokens)
        new_text = _decode(self._tokenizer, self._window_ids, self._skip_special_tokens)
        # Not longer: the token added no text (a skipped special token); keep it in the window for now.
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_REPLACEMENT_CHAR) and not final):
            return ""
        delta = new_text[len(prefix_text) :]
        self._text += delta
        # The tokens just emitted become the next window's prefix; older ones are no longer needed.
        del self._window_ids[: self._read_offset]
        self._read_offset = len(self._window_ids)
        return delta
