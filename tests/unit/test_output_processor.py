"""The output processor with the tiny byte-level tokenizer: every expected text comes from the tokenizer alone
(tokenizer.decode of fixed id lists and string slicing), never from the processor."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.output_processor import OutputDelta, OutputProcessor
from engine.types import FinishReason, Logprob, SamplingParams

REPLACEMENT_CHAR = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def feed(tokenizer: PreTrainedTokenizerBase, output_ids: list[int], params: SamplingParams,
         finish_reason: FinishReason | None = FinishReason.LENGTH, stop_reason: int | None = None
         ) -> tuple[OutputProcessor, list[OutputDelta]]:
    """Feeds output_ids as an engine would, the last one with the engine's finish; stops once finished."""
    processor = OutputProcessor(tokenizer, encode(tokenizer, "Once upon a time"), params)
    deltas = []
    for i, token_id in enumerate(output_ids):
        last = i == len(output_ids) - 1
        deltas.append(processor.update(token_id, None, finish_reason if last else None, stop_reason if last else None))
        if processor.finished:
            break
    return processor, deltas


def sent(deltas: list[OutputDelta]) -> str:
    return "".join(d.text for d in deltas)


def test_without_stops_the_text_is_the_tokenizers_decode(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, "The license of Python software")
    processor, deltas = feed(tokenizer, ids, SamplingParams())
    assert sent(deltas) == processor.text == tokenizer.decode(ids)
    assert processor.finish_reason == FinishReason.LENGTH and processor.token_ids == ids


@pytest.mark.parametrize("include_stop_str_in_output", [False, True])
def test_a_stop_string_spanning_tokens_ends_the_text(tokenizer: PreTrainedTokenizerBase,
                                                      include_stop_str_in_output: bool) -> None:
    ids = encode(tokenizer, "The license of Python software")
    pieces = [tokenizer.decode([t]) for t in ids]
    stop = " of Py"  # starts with the token " of", ends inside " Python"
    assert " of" in pieces and not any(stop in p for p in pieces), pieces
    full = tokenizer.decode(ids)
    end = full.index(stop) + (len(stop) if include_stop_str_in_output else 0)
    params = SamplingParams(stop=[stop, "never there"], include_stop_str_in_output=include_stop_str_in_output)
    processor, deltas = feed(tokenizer, ids, params)
    assert sent(deltas) == processor.text == full[:end]
    assert processor.finish_reason == FinishReason.STOP and processor.stop_reason == stop
    # it ends at the token that completes the stop string, which stays in token_ids
    assert processor.token_ids == ids[: pieces.index(" Python") + 1]
    assert deltas[-1].finished and deltas[-1].stop_reason == stop


@pytest.mark.parametrize("include_stop_str_in_output", [False, True])
def test_a_stop_string_inside_one_token_drops_the_rest_of_it(tokenizer: PreTrainedTokenizerBase,
                                                              include_stop_str_in_output: bool) -> None:
    ids = encode(tokenizer, "The license of Python software")
    stop = "icen"
    assert tokenizer.decode([ids[1]]) == " license"
    expected = "The licen" if include_stop_str_in_output else "The l"
    params = SamplingParams(stop=stop, include_stop_str_in_output=include_stop_str_in_output)
    processor, deltas = feed(tokenizer, ids, params)
    assert sent(deltas) == processor.text == expected
    assert processor.token_ids == ids[:2] and processor.stop_reason == stop


def test_the_earliest_stop_string_wins(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, "The license of Python software")
    processor, _ = feed(tokenizer, ids, SamplingParams(stop=["ns", "ic"]))  # both in " license"
    assert processor.text == "The l" and processor.stop_reason == "ic"


def test_a_stop_string_in_the_prompt_only_does_not_stop(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, "the end")
    processor, _ = feed(tokenizer, ids, SamplingParams(stop="upon"))  # feed's prompt: "Once upon a time"
    assert processor.text == "the end" and processor.finish_reason == FinishReason.LENGTH


def test_a_stop_string_wins_over_a_length_finish_on_the_same_token(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, "the end")
    processor, _ = feed(tokenizer, ids, SamplingParams(stop="nd"), FinishReason.LENGTH)
    assert processor.text == "the e"
    assert processor.finish_reason == FinishReason.STOP and processor.stop_reason == "nd"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("include_stop_str_in_output", [False, True])
def test_eos_text_is_left_out_unless_include_stop_str_in_output(
        tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool, include_stop_str_in_output: bool) -> None:
    eos = tokenizer.eos_token_id
    ids = [*encode(tokenizer, "the end"), eos]
    params = SamplingParams(skip_special_tokens=skip_special_tokens,
                            include_stop_str_in_output=include_stop_str_in_output)
    processor, deltas = feed(tokenizer, ids, params, FinishReason.STOP, stop_reason=None)
    shown = ids if include_stop_str_in_output else ids[:-1]
    assert sent(deltas) == processor.text == tokenizer.decode(shown, skip_special_tokens=skip_special_tokens)
    assert processor.token_ids == ids  # the EOS token counts, its text does not
    assert processor.finish_reason == FinishReason.STOP and processor.stop_reason is None
    if include_stop_str_in_output and not skip_special_tokens:
        assert processor.text == "the end<|endoftext|>"


@pytest.mark.parametrize("include_stop_str_in_output", [False, True])
def test_a_stop_token_id_is_reported_and_its_text_left_out_unless_asked(
        tokenizer: PreTrainedTokenizerBase, include_stop_str_in_output: bool) -> None:
    ids = encode(tokenizer, "the end of")
    params = SamplingParams(stop_token_ids=[ids[-1]], include_stop_str_in_output=include_stop_str_in_output)
    processor, deltas = feed(tokenizer, ids, params, FinishReason.STOP, stop_reason=ids[-1])
    shown = ids if include_stop_str_in_output else ids[:-1]
    assert sent(deltas) == processor.text == tokenizer.decode(shown)
    assert processor.finish_reason == FinishReason.STOP and processor.stop_reason == ids[-1]


def test_stop_strings_only_count_after_min_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, "the end of the file")
    assert [tokenizer.decode([t]) for t in ids[:4]] == ["the", " end", " of", " the"]
    at_once, _ = feed(tokenizer, ids, SamplingParams(stop="the"))
    assert at_once.text == "" and at_once.token_ids == ids[:1]
    # within the first min_tokens tokens "the" does not count; the next one, in the 4th token, does
    later, _ = feed(tokenizer, ids, SamplingParams(stop="the", min_tokens=1))
    assert later.text == tokenizer.decode(ids[:4])[: -len("the")] and later.token_ids == ids[:4]
    never, _ = feed(tokenizer, ids, SamplingParams(stop="the", min_tokens=4))
    assert never.text == tokenizer.decode(ids) and never.finish_reason == FinishReason.LENGTH


def test_a_stop_string_may_start_within_min_tokens_and_end_after(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, "the end of the file")
    processor, _ = feed(tokenizer, ids, SamplingParams(stop="end of", min_tokens=2))
    assert processor.text == "the " and processor.token_ids == ids[:3]


def test_holdback_never_sends_a_prefix_of_a_stop_string_that_then_completes(
        tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, "the end of the file")
    stop = " of the f"  # spans " of", " the" and " f"
    processor, deltas = feed(tokenizer, ids, SamplingParams(stop=stop))
    full = tokenizer.decode(ids)
    assert [d.text for d in deltas] == ["the", " end", "", "", ""]
    assert sent(deltas) == processor.text == full[: full.index(stop)]


def test_held_back_text_goes_out_once_it_cannot_become_a_stop_string(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, "the end of the file")
    processor, deltas = feed(tokenizer, ids, SamplingParams(stop=" of the fox"))
    texts = [tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]
    # " of", " of the" and " of the f" begin the stop string and wait; "i" rules it out
    assert [sent(deltas[:k]) for k in range(1, len(ids) + 1)] == [
        texts[1], texts[2], texts[2], texts[2], texts[2], texts[6], texts[7]]
    assert processor.finish_reason == FinishReason.LENGTH


def test_held_back_text_is_flushed_when_the_request_ends(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, "the end of")
    processor, deltas = feed(tokenizer, ids, SamplingParams(stop=" of the"), FinishReason.LENGTH)
    assert [d.text for d in deltas] == ["the", " end", " of"]
    assert sent(deltas) == tokenizer.decode(ids)
    aborted, deltas = feed(tokenizer, ids, SamplingParams(stop=" of the"), finish_reason=None)
    assert sent(deltas) == "the end" and not aborted.finished
    last = aborted.finish(FinishReason.ABORT)
    assert last.text == " of" and last.finish_reason == FinishReason.ABORT


def test_nothing_is_held_back_when_the_stop_string_is_shown_anyway(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, "the end of the file")
    params = SamplingParams(stop=" of the f", include_stop_str_in_output=True)
    processor, deltas = feed(tokenizer, ids, params)
    assert [d.text for d in deltas] == [tokenizer.decode([t]) for t in ids[:5]]
    assert processor.text == "the end of the f"


def test_characters_split_across_tokens_are_sent_whole(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, "ab 日本")
    assert sum(REPLACEMENT_CHAR in tokenizer.decode([t]) for t in ids) >= 4, "the CJK should be byte tokens"
    processor, deltas = feed(tokenizer, ids, SamplingParams())
    assert not any(REPLACEMENT_CHAR in d.text for d in deltas)
    assert sent(deltas) == processor.text == "ab 日本" == tokenizer.decode(ids)
    # a request that ends mid-character shows what the tokenizer shows: a replacement character
    cut, deltas = feed(tokenizer, ids[:-1], SamplingParams())
    assert sent(deltas) == cut.text == tokenizer.decode(ids[:-1]) and cut.text.endswith(REPLACEMENT_CHAR)


def test_a_multibyte_stop_string_spanning_byte_tokens_is_found(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, "ab 日本")
    processor, deltas = feed(tokenizer, ids, SamplingParams(stop="本"))
    assert sent(deltas) == processor.text == "ab 日" and processor.stop_reason == "本"


def test_logprobs_get_each_tokens_text_and_add_up(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, "the end")
    processor = OutputProcessor(tokenizer, [], SamplingParams(logprobs=1))
    positions = [{ids[0]: Logprob(-0.5, 1), 7: Logprob(-1.5, 2)}, {ids[1]: Logprob(-0.25, 1)}]
    first = processor.update(ids[0], positions[0])
    processor.update(ids[1], positions[1], FinishReason.LENGTH)
    assert first.logprobs is not None and first.logprobs[7].decoded_token == tokenizer.decode([7])
    output = processor.completion_output(index=3)
    assert output.logprobs is not None
    assert [{t: lp.decoded_token for t, lp in p.items()} for p in output.logprobs] == [
        {ids[0]: "the", 7: tokenizer.decode([7])}, {ids[1]: " end"}]
    assert output.cumulative_logprob == -0.75 and output.index == 3
    assert (output.text, output.token_ids, output.finish_reason) == ("the end", ids, FinishReason.LENGTH)
