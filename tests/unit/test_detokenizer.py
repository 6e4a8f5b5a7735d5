from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.detokenizer import IncrementalDetokenizer, decode_token

REPLACEMENT_CHAR = "\ufffd"
WORDS = [
    "hello", "héllo", "world", "wörld", "日本語", "日本", "🙂", "🎉", "naïve", "café", "déjà", "vu",
    "Привет", "мир", "你好", "世界", "ελληνικά", "the", "quick", "brown", "fox", "jumps", "—", "“quoted”",
    "½", "∑", "end", "stop", "a", "b", ",", ".",
]  # fmt: skip
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]
PROMPT_TEXT = "hello wörld, "
SAMPLE_TEXT = "héllo wörld 日本語 🙂 Привет 你好世界 🎉 naïve café — “quoted” ½ ∑ the end"


def _training_lines() -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(400)]


def _wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    # No clean-up: it rewrites " ." to "." across the whole text, which no windowed decode can reproduce.
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    """A tiny byte-level BPE: so few merges that most non-ASCII characters span several tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(_training_lines(), trainer)
    return _wrap(tokenizer)


@pytest.fixture(scope="module")
def sentencepiece_like() -> PreTrainedTokenizerFast:
    """A Metaspace ("▁word") tokenizer: its decode drops the leading space of a sequence's first piece."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"])
    tokenizer.train_from_iterator(_training_lines(), trainer)
    return _wrap(tokenizer)


def encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def detokenize(
    tokenizer: PreTrainedTokenizerFast, prompt_ids: list[int], output_ids: list[int], skip_special_tokens: bool = True
) -> tuple[IncrementalDetokenizer, list[str]]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    pieces = [detokenizer.push(token_id) for token_id in output_ids]
    return detokenizer, pieces


def test_the_test_tokenizer_splits_characters_across_tokens(byte_level: PreTrainedTokenizerFast) -> None:
    ids = encode(byte_level, SAMPLE_TEXT)
    assert byte_level.decode(ids) == SAMPLE_TEXT
    assert sum(REPLACEMENT_CHAR in byte_level.decode([token_id]) for token_id in ids) >= 5


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_text_equals_full_decode_of_random_ids(
    byte_level: PreTrainedTokenizerFast, skip_special_tokens: bool
) -> None:
    rng = random.Random(1)
    prompt_ids = encode(byte_level, PROMPT_TEXT)
    vocab_size = len(byte_level)
    for _ in range(300):
        output_ids = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 40))]
        detokenizer, pieces = detokenize(byte_level, prompt_ids, output_ids, skip_special_tokens)
        pieces.append(detokenizer.flush())
        expected = byte_level.decode(output_ids, skip_special_tokens=skip_special_tokens)
        assert "".join(pieces) == expected == detokenizer.text, output_ids


def test_push_never_emits_a_partial_character(byte_level: PreTrainedTokenizerFast) -> None:
    output_ids = encode(byte_level, SAMPLE_TEXT)
    detokenizer, pieces = detokenize(byte_level, encode(byte_level, PROMPT_TEXT), output_ids)
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)
    assert pieces.count("") >= 3, "characters split across tokens should be held back"
    assert "".join(pieces) == detokenizer.text == SAMPLE_TEXT
    assert detokenizer.flush() == ""


def test_flush_releases_an_unfinished_character_at_the_end(byte_level: PreTrainedTokenizerFast) -> None:
    ids = encode(byte_level, "a 🙂")
    assert len(ids) >= 3, "the emoji should span tokens"
    detokenizer, pieces = detokenize(byte_level, [], ids[:-1])
    assert pieces[-1] == ""
    held_back = detokenizer.flush()
    assert held_back.endswith(REPLACEMENT_CHAR)
    assert detokenizer.text == byte_level.decode(ids[:-1])


def test_special_tokens_are_skipped_or_kept_as_asked(byte_level: PreTrainedTokenizerFast) -> None:
    eos_id = byte_level.convert_tokens_to_ids("<|endoftext|>")
    output_ids = [*encode(byte_level, "日本"), eos_id, *encode(byte_level, " end")]
    skipped, _ = detokenize(byte_level, [], output_ids, skip_special_tokens=True)
    kept, _ = detokenize(byte_level, [], output_ids, skip_special_tokens=False)
    assert skipped.text == "日本 end"
    assert kept.text == "日本<|endoftext|> end"


def test_first_output_token_keeps_its_leading_space_thanks_to_prompt_context(
    sentencepiece_like: PreTrainedTokenizerFast,
) -> None:
    prompt_ids = encode(sentencepiece_like, "the quick brown")
    output_ids = encode(sentencepiece_like, "fox jumps")
    assert sentencepiece_like.convert_ids_to_tokens(output_ids[0]).startswith("\u2581")
    detokenizer, pieces = detokenize(sentencepiece_like, prompt_ids, output_ids)
    full = sentencepiece_like.decode(prompt_ids + output_ids)
    prompt_text = sentencepiece_like.decode(prompt_ids)
    assert "".join(pieces) == detokenizer.text == full[len(prompt_text) :] == " fox jumps"


def test_without_a_prompt_the_first_token_decodes_as_a_sequence_start(
    sentencepiece_like: PreTrainedTokenizerFast,
) -> None:
    output_ids = encode(sentencepiece_like, "fox jumps")
    detokenizer, _ = detokenize(sentencepiece_like, [], output_ids)
    assert detokenizer.text == sentencepiece_like.decode(output_ids) == "fox jumps"


def test_decode_token_shows_one_token_with_its_leading_space(
    byte_level: PreTrainedTokenizerFast, sentencepiece_like: PreTrainedTokenizerFast
) -> None:
    [fox] = [t for t in encode(sentencepiece_like, "the fox") if sentencepiece_like.decode([t]) == "fox"]
    assert decode_token(sentencepiece_like, fox) == " fox"
    naive = encode(byte_level, "a naïve")[-1]
    assert decode_token(byte_level, naive) == " naïve"
    eos_id = byte_level.convert_tokens_to_ids("<|endoftext|>")
    assert decode_token(byte_level, eos_id) == "<|endoftext|>"


def test_decode_token_shows_a_partial_character_as_the_replacement_char(
    byte_level: PreTrainedTokenizerFast,
) -> None:
    first_byte_of_emoji = encode(byte_level, "🙂")[0]
    assert decode_token(byte_level, first_byte_of_emoji) == REPLACEMENT_CHAR
