"""Token ids in, the user's text out: the one place that decides what text a request shows.

Torch-free: the offline `LLM` and the proxy both use it. The engine finishes requests at the token level only
(EOS, stop_token_ids, max_tokens, the context length) and reports each sampled token with that verdict; this
module turns the tokens into text by vLLM's rules:

1. EOS and stop token ids: when the engine finishes a request because of one (FinishReason.STOP), that token's
   text is not part of the output, unless include_stop_str_in_output. This holds for special tokens shown by
   skip_special_tokens=False too. The token itself stays in token_ids.
2. Stop strings: the first one found in the text ends the request with FinishReason.STOP and
   stop_reason = the string. The text is cut before it (after it with include_stop_str_in_output); the rest
   of the token that completed it is dropped. The earliest match wins. The engine does not know: the caller
   must abort the request there (or on the nodes).
3. min_tokens: stop strings count only once the output has more than min_tokens tokens, i.e. a match must end
   in the text of a token after the first min_tokens. (The engine suppresses EOS and stop ids until then.)
4. Holdback while streaming: a delta never shows text that a later token could still turn into a stop string.
   The longest tail of the text that begins some stop string is held back until it cannot (or the request
   ends). With include_stop_str_in_output nothing is held back for stop strings: they are shown anyway. An
   unfinished UTF-8 character is held back too (by the detokenizer) and shows as U+FFFD only if the request
   ends on it.

One OutputProcessor per request (per sample with n > 1). Driving it:

    processor = OutputProcessor(tokenizer, prompt_token_ids, params)
    for each engine step output of this request:
        delta = processor.update(token_id, logprobs, finish_reason, stop_reason)
        show(delta.text)
        if delta.finish_reason is not None and finish_reason is None:  # a stop string ended it
            abort the request in the engine / on the nodes
    processor.completion_output(index)  # the whole output, for an offline caller
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from engine.detokenizer import IncrementalDetokenizer, TokenizerLike, decode_token
from engine.types import CompletionOutput, FinishReason, PositionLogprobs, PromptLogprobs, SamplingParams


@dataclass(frozen=True)
class OutputDelta:
    """What one update adds for the user. `text` is the new text to show (may be ""); `logprobs` holds the
    update's token's logprobs with decoded_token filled in (None when none were given)."""

    text: str
    token_id: int | None  # None for finish() without a token
    logprobs: PositionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id; None for EOS, length, abort

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _StopStrings:
    """Stop-string matching over a growing text (rules 2-4 of the module docstring)."""

    strings: list[str]
    include_in_output: bool
    num_checked_chars: int = 0  # no stop string ends before this index of the text
    holdback_lengths: list[int] = field(init=False)

    def __post_init__(self) -> None:
        # proper prefixes of any stop string, by length: the candidates for a held-back tail
        self.holdback_lengths = sorted({k for s in self.strings for k in range(1, len(s))}, reverse=True)

    def skip(self, text: str) -> None:
        """Text so far ends no stop string (output within min_tokens): later matches must end after it."""
        self.num_checked_chars = len(text)

    def find(self, text: str) -> tuple[int, str] | None:
        """The earliest stop string that ends in text added since the last call: (its start, the string)."""
        best: tuple[int, str] | None = None
        for stop in self.strings:
            start = text.find(stop, max(0, self.num_checked_chars - len(stop) + 1))
            if start != -1 and (best is None or start < best[0]):
                best = (start, stop)
        self.num_checked_chars = len(text)
        return best

    def num_held_chars(self, text: str) -> int:
        """Length of the longest tail of text that a later token could complete into a stop string."""
        if self.include_in_output:
            return 0
        for length in self.holdback_lengths:
            tail = text[-length:] if length <= len(text) else None
            if tail is not None and any(len(s) > length and s.startswith(tail) for s in self.strings):
                return length
        return 0


class OutputProcessor:
    """One request's output: its token ids, logprobs and text, and the text's own finish (a stop string).

    Feed it every token the engine samples for the request, in order, with the engine's token-level finish;
    it returns each time what is new for the user. See the module docstring for the rules. `token_texts` is an
    optional cache of decode_token results that callers may share between requests of one tokenizer.
    """

    def __init__(self, tokenizer: TokenizerLike | None, prompt_token_ids: Sequence[int], params: SamplingParams,
                 token_texts: dict[int, str] | None = None) -> None:
        """Without a tokenizer (an engine started with skip_tokenizer_init) the output is token ids only."""
        if tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer; this engine was started with skip_tokenizer_init")
        self._tokenizer = tokenizer
        self._params = params
        self._detokenizer: IncrementalDetokenizer | _NoText = (
            _NoText() if tokenizer is None else
            IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens))
        self._stop_strings = _StopStrings(list(params.stop or []), params.include_stop_str_in_output)
        self._token_texts = token_texts if token_texts is not None else {}
        self._text = ""  # the output text: the detokenizer's, cut at a stop string
        self._num_sent_chars = 0  # text before this index went out in deltas
        self.token_ids: list[int] = []
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None

    @property
    def text(self) -> str:
        """The output text so far, held-back text included (final once finished)."""
        return self._text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, token_id: int, logprobs: PositionLogprobs | None = None,
               finish_reason: FinishReason | None = None, stop_reason: int | None = None) -> OutputDelta:
        """Takes the next sampled token and the engine's verdict on it: finish_reason STOP (stop_reason = the
        stop token id, None for EOS), LENGTH, or None. Returns the text now safe to show and the request's
        finish, which is STOP with the stop string as stop_reason when a stop string ended it."""
        assert not self.finished, "update after the output finished: the caller must stop (and abort) the request"
        self.token_ids.append(token_id)
        logprobs = self._with_decoded_tokens(logprobs) if logprobs is not None else None
        if logprobs is not None and self.logprobs is not None:
            self.logprobs.append(logprobs)
            sampled = logprobs.get(token_id)
            if sampled is not None:
                self.cumulative_logprob += sampled.logprob
        # rule 1: the text of the EOS or stop token that ended the request is left out unless asked for
        if finish_reason is not FinishReason.STOP or self._params.include_stop_str_in_output:
            self._detokenizer.push(token_id)
        if finish_reason is not None:
            self._detokenizer.flush()  # an unfinished character at the very end shows as U+FFFD
        self._text = self._detokenizer.text
        stop_string = self._find_stop_string()
        if stop_string is not None:
            self.finish_reason, self.stop_reason = FinishReason.STOP, stop_string
        elif finish_reason is not None:
            self.finish_reason, self.stop_reason = finish_reason, stop_reason
        return OutputDelta(self._take_text(), token_id, logprobs, self.finish_reason, self.stop_reason)

    def _find_stop_string(self) -> str | None:
        """Rules 2 and 3: the stop string that the newest text completes, if any; cuts the text there."""
        if not self._stop_strings.strings:
            return None
        if len(self.token_ids) <= self._params.min_tokens:
            self._stop_strings.skip(self._text)
            return None
        match = self._stop_strings.find(self._text)
        if match is None:
            return None
        start, stop = match
        self._text = self._text[: start + len(stop) if self._params.include_stop_str_in_output else start]
        return stop

    def finish(self, finish_reason: FinishReason, stop_reason: int | None = None) -> OutputDelta:
        """Ends the output without a new token (an abort, or a finish reported after its token): releases the
        text held back, since no stop string can complete now."""
        assert not self.finished, "finish after the output finished"
        self._detokenizer.flush()
        self._text = self._detokenizer.text
        self.finish_reason, self.stop_reason = finish_reason, stop_reason
        return OutputDelta(self._take_text(), None, None, finish_reason, stop_reason)

    def completion_output(self, index: int = 0) -> CompletionOutput:
        """The whole output so far, as the offline API returns it."""
        return CompletionOutput(
            index=index, text=self._text, token_ids=list(self.token_ids), finish_reason=self.finish_reason,
            stop_reason=self.stop_reason, logprobs=None if self.logprobs is None else list(self.logprobs),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None)

    def with_decoded_prompt_tokens(self, prompt_logprobs: PromptLogprobs) -> PromptLogprobs:
        """A prompt's logprobs (StepOutput.prompt_logprobs, as the nodes send them) with decoded_token filled in, as
        vLLM returns them."""
        return [None if position is None else self._with_decoded_tokens(position) for position in prompt_logprobs]

    def token_text(self, token_id: int) -> str:
        """One token's text on its own, as Logprob.decoded_token shows it (cached in token_texts)."""
        text = self._token_texts.get(token_id)
        if text is None:
            assert self._tokenizer is not None, "token texts need a tokenizer"
            text = self._token_texts[token_id] = decode_token(self._tokenizer, token_id)
        return text

    def _take_text(self) -> str:
        """The text not yet sent that no later token can take back (rule 4); all of it once finished."""
        end = len(self._text)
        if not self.finished:
            end = max(self._num_sent_chars, end - self._stop_strings.num_held_chars(self._text))
        assert end >= self._num_sent_chars, "a stop string cut into text already sent: holdback is broken"
        delta = self._text[self._num_sent_chars : end]
        self._num_sent_chars = end
        return delta

    def _with_decoded_tokens(self, logprobs: PositionLogprobs) -> PositionLogprobs:
        if self._tokenizer is None:
            return logprobs
        return {token_id: replace(logprob, decoded_token=self.token_text(token_id))
                for token_id, logprob in logprobs.items()}


class _NoText:
    """The detokenizer of an output without a tokenizer: no text at all."""

    text = ""

    def push(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""
