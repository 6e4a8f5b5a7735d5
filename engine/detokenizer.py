"""Incremental detokenization of one sequence: text grows token by token, and stop strings end it.

Torch-free so that the proxy can use it as well as the engine.

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

from engine.types import SamplingParams

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
    """Text of one output sequence, pushed a token at a time.

    Per step the engine calls push(token_id) then check_stop(); when the sequence ends for another reason
    (eos, stop token, length) it calls flush() to release a character still held back. A stop token that
    ends the sequence should not be pushed unless its text belongs in the output (vLLM leaves it out).
    """

    def __init__(self, tokenizer: TokenizerLike, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        stop = params.stop
        self._stop_strings: list[str] = [stop] if isinstance(stop, str) else list(stop or [])
        self._include_stop_str_in_output = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens

        # The decode window. Invariant: _window_ids[:_read_offset] decode to text already accounted for
        # (emitted, or prompt context); _window_ids[_read_offset:] are pushed tokens whose text is held back.
        # The window starts at the prefix offset: older ids are dropped, so it stays a few tokens long.
        self._window_ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._read_offset = len(self._window_ids)

        self._text = ""
        self._num_output_tokens = 0
        self._num_checked_chars = 0  # text before this index holds no stop string
        self._stop_reason: str | None = None

    @property
    def text(self) -> str:
        """The output text so far, truncated at a stop string once one is found."""
        return self._text

    @property
    def stop_reason(self) -> str | None:
        """The stop string found by check_stop, if any."""
        return self._stop_reason

    def push(self, token_id: int) -> str:
        """Appends one output token and returns the text it adds: "" while it leaves a character unfinished.

        The return value is before stop-string truncation; `text` is the authoritative output.
        """
        assert self._stop_reason is None, "push after a stop string ended the sequence"
        self._window_ids.append(token_id)
        self._num_output_tokens += 1
        return self._advance(final=False)

    def flush(self) -> str:
        """Emits the text held back at the end of a finished sequence (an unfinished character shows as
        U+FFFD). Returns what it added: nothing after a stop string, whose truncation already cut it off."""
        if self._stop_reason is not None or self._read_offset == len(self._window_ids):
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

    def check_stop(self) -> str | None:
        """Returns the stop string if the text now contains one of params.stop, and truncates the text at it
        (keeping the stop string with include_stop_str_in_output). The earliest match wins.

        Only text added since the last call is searched, plus the len(stop) - 1 characters before it that a
        stop string spanning tokens may start in. As in vLLM, stop strings count only once the output is
        longer than min_tokens tokens. After a hit, returns the same stop string again.
        """
        if self._stop_reason is not None:
            return self._stop_reason
        if not self._stop_strings or len(self._text) == self._num_checked_chars:
            return None
        if self._num_output_tokens <= self._min_tokens:
            self._num_checked_chars = len(self._text)
            return None
        best: tuple[int, str] | None = None
        for stop in self._stop_strings:
            index = self._text.find(stop, max(0, self._num_checked_chars - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        self._num_checked_chars = len(self._text)
        if best is None:
            return None
        index, stop = best
        self._text = self._text[: index + len(stop) if self._include_stop_str_in_output else index]
        self._num_checked_chars = len(self._text)
        self._stop_reason = stop
        return stop
