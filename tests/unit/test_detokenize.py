"""Streaming detokenization and stop strings (coordinator/detokenize.py)."""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from outrider import model_specs
from outrider.coordinator.detokenize import IncrementalDetokenizer, StopStringMatcher, TextStream
from tests.tiny import EOS_TOKEN_ID, build_tiny_sentencepiece_tokenizer

MULTIBYTE = "héllo wörld 日本語 🙂"
SMOLLM2_DIR = model_specs.model_path(model_specs.DEFAULT_MODEL)  # (OUTRIDER_CACHE_DIR's, where set)


@pytest.fixture(scope="module")
def byte_level(tiny_tokenizer_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    path = tmp_path_factory.mktemp("tiny-sentencepiece")
    build_tiny_sentencepiece_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def smollm2() -> PreTrainedTokenizerBase:
    if not (SMOLLM2_DIR / "tokenizer.json").is_file():
        pytest.skip(f"no SmolLM2 tokenizer at {SMOLLM2_DIR}")
    return AutoTokenizer.from_pretrained(SMOLLM2_DIR)


def _chat_prompt(tokenizer: PreTrainedTokenizerBase, content: str = "Say something.") -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


def _add_all(stream: TextStream | IncrementalDetokenizer, token_ids: Iterable[int]) -> list[str]:
    """Add tokens one by one, as the coordinator does, until a stop ends the stream."""
    deltas = []
    for token_id in token_ids:
        deltas.append(stream.add(token_id))
        if isinstance(stream, TextStream) and stream.ended:
            break
    return deltas


def _pieces(tokenizer: PreTrainedTokenizerBase, token_ids: list[int]) -> list[str]:
    return [tokenizer.decode([i]) for i in token_ids]


# --- IncrementalDetokenizer -------------------------------------------------------------


def test_multibyte_characters_split_across_byte_tokens_stream_without_replacement_chars(
    byte_level: PreTrainedTokenizerBase,
) -> None:
    generated = byte_level.encode(MULTIBYTE)
    assert any("\ufffd" in piece for piece in _pieces(byte_level, generated))  # the premise
    detokenizer = IncrementalDetokenizer(byte_level, _chat_prompt(byte_level))

    deltas = _add_all(detokenizer, generated)
    rest = detokenizer.flush()

    assert "".join(deltas) + rest == byte_level.decode(generated) == MULTIBYTE
    assert rest == ""
    assert not any("\ufffd" in delta for delta in deltas)
    assert "" in deltas  # some tokens were held back until their character was complete
    assert detokenizer.text == MULTIBYTE


def test_emoji_is_emitted_whole_by_the_token_that_completes_it(
    byte_level: PreTrainedTokenizerBase,
) -> None:
    prompt = byte_level.encode("I feel ")
    generated = byte_level.encode("🙂")
    assert len(generated) == 4  # one token per UTF-8 byte

    deltas = _add_all(IncrementalDetokenizer(byte_level, prompt), generated)

    assert deltas == ["", "", "", "🙂"]


def test_byte_fallback_characters_stream_without_replacement_chars(
    sentencepiece: PreTrainedTokenizerBase,
) -> None:
    text = "party 🎉 time ✨"  # neither emoji is in the training corpus: byte-fallback tokens
    generated = sentencepiece.encode(text, add_special_tokens=False)
    assert any(sentencepiece.convert_ids_to_tokens(i).startswith("<0x") for i in generated)
    detokenizer = IncrementalDetokenizer(
        sentencepiece, sentencepiece.encode("A", add_special_tokens=False)
    )

    deltas = _add_all(detokenizer, generated)

    assert not any("\ufffd" in delta for delta in deltas)
    assert "".join(deltas) + detokenizer.flush() == " " + text


def test_spaces_between_words_are_kept_with_byte_level_spaces(
    byte_level: PreTrainedTokenizerBase,
) -> None:
    generated = byte_level.encode(" the quick brown fox jumps over the lazy dog")
    assert byte_level.convert_ids_to_tokens(generated[1]).startswith("Ġ")

    deltas = _add_all(IncrementalDetokenizer(byte_level, byte_level.encode("See")), generated)

    assert deltas == _pieces(byte_level, generated)
    assert "".join(deltas) == " the quick brown fox jumps over the lazy dog"


def test_first_token_takes_its_leading_space_from_the_prompt_context(
    sentencepiece: PreTrainedTokenizerBase,
) -> None:
    prompt = sentencepiece.encode("hello", add_special_tokens=False)
    full = sentencepiece.encode("hello world", add_special_tokens=False)
    generated = full[len(prompt) :]
    assert full[: len(prompt)] == prompt
    assert sentencepiece.decode(generated) == "world"  # decoded alone, the space is lost

    detokenizer = IncrementalDetokenizer(sentencepiece, prompt)

    assert "".join(_add_all(detokenizer, generated)) == " world"


def test_sentencepiece_words_keep_their_spaces_in_a_long_generation(
    sentencepiece: PreTrainedTokenizerBase,
) -> None:
    prompt = sentencepiece.encode("Once upon a time", add_special_tokens=False)
    continuation = " there was a little robot who wanted to write poems about the weather."
    full = sentencepiece.encode("Once upon a time" + continuation, add_special_tokens=False)
    assert full[: len(prompt)] == prompt

    deltas = _add_all(IncrementalDetokenizer(sentencepiece, prompt), full[len(prompt) :])

    assert "".join(deltas) == continuation


def test_special_tokens_are_skipped_unless_asked_for(byte_level: PreTrainedTokenizerBase) -> None:
    generated = [*byte_level.encode("Done."), EOS_TOKEN_ID]
    prompt = _chat_prompt(byte_level)

    skipped = _add_all(IncrementalDetokenizer(byte_level, prompt), generated)
    kept = _add_all(
        IncrementalDetokenizer(byte_level, prompt, skip_special_tokens=False), generated
    )

    assert "".join(skipped) == "Done." and skipped[-1] == ""
    assert "".join(kept) == "Done.<|im_end|>"


def test_flush_releases_an_incomplete_character_as_replacement_char(
    byte_level: PreTrainedTokenizerBase,
) -> None:
    emoji = byte_level.encode("🙂")
    detokenizer = IncrementalDetokenizer(byte_level, byte_level.encode("Hi "))

    assert _add_all(detokenizer, emoji[:2]) == ["", ""]
    assert detokenizer.flush() == "\ufffd"
    assert detokenizer.text == "\ufffd"


def test_empty_prompt_starts_the_window_at_the_first_generated_token(
    byte_level: PreTrainedTokenizerBase,
) -> None:
    generated = byte_level.encode(MULTIBYTE)
    assert "".join(_add_all(IncrementalDetokenizer(byte_level, []), generated)) == MULTIBYTE


# --- StopStringMatcher ------------------------------------------------------------------


def test_stop_string_spanning_two_chunks_is_cut_and_never_shown() -> None:
    matcher = StopStringMatcher(["STOP"])

    assert matcher.feed("Hello ST") == "Hello "
    assert matcher.held == "ST"
    assert matcher.feed("OP and more") == ""
    assert matcher.stopped == "STOP"


def test_partial_stop_string_that_diverges_is_released() -> None:
    matcher = StopStringMatcher(["hello world"])

    assert matcher.feed("say hel") == "say "
    assert matcher.feed("lo") == ""
    assert matcher.feed(" there") == "hello there"
    assert matcher.stopped is None


def test_earliest_stop_string_wins_regardless_of_list_order() -> None:
    matcher = StopStringMatcher(["fox", "quick"])

    assert matcher.feed("the quick brown fox") == "the "
    assert matcher.stopped == "quick"


def test_overlapping_stop_strings_give_the_same_cut_however_the_text_is_chunked() -> None:
    # "c" is completed before "bcd" is, whether the text comes at once or char by char.
    whole = StopStringMatcher(["bcd", "c"])
    out_whole = whole.feed("abcde")
    by_char = StopStringMatcher(["bcd", "c"])
    out_by_char = ""
    for char in "abcde":
        out_by_char += by_char.feed(char)
        if by_char.stopped:
            break

    assert out_whole == out_by_char == "ab"
    assert whole.stopped == by_char.stopped == "c"


def test_finish_releases_a_held_partial_stop_string() -> None:
    matcher = StopStringMatcher(["</answer>"])

    assert matcher.feed("42 </ans") == "42 "
    assert matcher.finish() == "</ans"


def test_feed_after_a_stop_string_matched_raises() -> None:
    matcher = StopStringMatcher(["x"])
    matcher.feed("x")
    with pytest.raises(RuntimeError):
        matcher.feed("more")


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


def test_matcher_agrees_with_a_whole_text_search_for_any_chunking() -> None:
    rng = random.Random(0)
    for _ in range(500):
        stops = ["".join(rng.choices("ab ", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choices("ab ", k=rng.randint(0, 30)))
        # Reference: the stop string completed first in the whole text.
        ends = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
        expected_stop = min(ends)[2] if ends else None
        expected_out = text[: min(ends)[1]] if ends else text

        matcher = StopStringMatcher(stops)
        out, i = "", 0
        while i < len(text) and matcher.stopped is None:
            chunk = text[i : i + rng.randint(1, 5)]
            i += len(chunk)
            out += matcher.feed(chunk)
            assert len(matcher.held) < max(map(len, stops))
        if matcher.stopped is None:
            out += matcher.finish()

        assert (out, matcher.stopped) == (expected_out, expected_stop), (stops, text)


# --- TextStream -------------------------------------------------------------------------


def test_stop_string_spanning_two_tokens_cuts_exactly(byte_level: PreTrainedTokenizerBase) -> None:
    text = "Hello world, hello again, world!"
    generated = byte_level.encode(text)
    stop = "o wor"
    assert not any(stop in piece for piece in _pieces(byte_level, generated))  # spans tokens
    stream = TextStream(byte_level, _chat_prompt(byte_level), stop=[stop])

    deltas = _add_all(stream, generated)

    assert stream.stopped == stop
    assert "".join(deltas) == stream.text == "Hell"
    assert stream.finish() == ""


def test_stop_string_inside_a_multi_token_commit_cuts_exactly(
    byte_level: PreTrainedTokenizerBase,
) -> None:
    # The coordinator commits several tokens per round; the stop string completes mid-commit.
    generated = byte_level.encode(MULTIBYTE + " and more")
    stop = "本"  # one character, three byte-level tokens
    stream = TextStream(byte_level, _chat_prompt(byte_level), stop=[stop, "never"])

    sent = ""
    for start in range(0, len(generated), 4):
        for token_id in generated[start : start + 4]:
            sent += stream.add(token_id)
            if stream.stopped:
                break
        if stream.stopped:
            break

    assert stream.stopped == stop
    assert sent == stream.text == "héllo wörld 日"
    assert byte_level.decode(generated[: stream.num_tokens]).endswith(stop)
    assert not byte_level.decode(generated[: stream.num_tokens - 1]).endswith(stop)


def test_add_after_a_stop_string_matched_raises(byte_level: PreTrainedTokenizerBase) -> None:
    stream = TextStream(byte_level, [], stop=["lo"])
    _add_all(stream, byte_level.encode("Hello world"))
    with pytest.raises(RuntimeError):
        stream.add(byte_level.encode("x")[0])


def test_partial_stop_string_that_diverges_is_released_to_the_client(
    byte_level: PreTrainedTokenizerBase,
) -> None:
    text = "The capital of France is Paris."
    stream = TextStream(byte_level, _chat_prompt(byte_level), stop=["The capital of Japan"])

    deltas = _add_all(stream, byte_level.encode(text))

    assert deltas[0] == ""  # "The" might have been the stop string
    assert "".join(deltas) + stream.finish() == text
    assert stream.stopped is None


def test_finish_releases_held_bytes_and_held_partial_stop_string(
    byte_level: PreTrainedTokenizerBase,
) -> None:
    generated = byte_level.encode("answer: 42 </ans")
    stream = TextStream(byte_level, [], stop=["</answer>"])

    sent = "".join(_add_all(stream, generated))

    assert sent == "answer: 42 "
    assert stream.finish() == "</ans"
    assert stream.text == "answer: 42 </ans"
    with pytest.raises(RuntimeError):
        stream.add(0)


def test_eos_is_not_text_and_does_not_trigger_a_stop(byte_level: PreTrainedTokenizerBase) -> None:
    stream = TextStream(byte_level, _chat_prompt(byte_level), stop=["<|im_end|>"])

    deltas = _add_all(stream, [*byte_level.encode("Bye."), EOS_TOKEN_ID])

    assert "".join(deltas) + stream.finish() == "Bye."
    assert stream.stopped is None


def test_special_token_can_be_a_stop_string_when_special_tokens_are_kept(
    byte_level: PreTrainedTokenizerBase,
) -> None:
    stream = TextStream(
        byte_level, _chat_prompt(byte_level), stop=["<|im_end|>"], skip_special_tokens=False
    )

    deltas = _add_all(stream, [*byte_level.encode("Bye."), EOS_TOKEN_ID])

    assert "".join(deltas) == "Bye."
    assert stream.stopped == "<|im_end|>"


def test_a_stop_token_ends_the_stream_and_its_text_is_left_out_unless_included(
    byte_level: PreTrainedTokenizerBase,
) -> None:
    generated = byte_level.encode("Hello world, hello again")
    stop_id = generated[2]
    before = byte_level.decode(generated[:2])
    for include, expected in ((False, before), (True, byte_level.decode(generated[:3]))):
        stream = TextStream(byte_level, [], stop_token_ids={stop_id}, include_stop=include)

        deltas = _add_all(stream, generated)

        assert stream.ended and stream.stopped is None and stream.num_tokens == 3
        assert "".join(deltas) + stream.finish() == stream.text == expected
        with pytest.raises(RuntimeError, match=f"stop token id {stop_id}"):
            stream.add(generated[3])


def test_eos_text_is_left_out_even_when_special_tokens_are_kept(
    byte_level: PreTrainedTokenizerBase,
) -> None:
    generated = [*byte_level.encode("Bye."), EOS_TOKEN_ID, *byte_level.encode(" Hi")]
    kept = TextStream(byte_level, [], stop_token_ids={EOS_TOKEN_ID}, skip_special_tokens=False)
    assert "".join(_add_all(kept, generated)) + kept.finish() == "Bye."
    # Not a stop token (ignore_eos): its text is there, as special tokens are kept.
    ignored = TextStream(byte_level, [], skip_special_tokens=False)
    assert "".join(_add_all(ignored, generated)) + ignored.finish() == "Bye.<|im_end|> Hi"


def test_an_included_stop_string_ends_the_text(byte_level: PreTrainedTokenizerBase) -> None:
    stream = TextStream(byte_level, [], stop=["o wor", "again"], include_stop=True)

    deltas = _add_all(stream, byte_level.encode("Hello world, hello again"))

    assert stream.stopped == "o wor" and "".join(deltas) == stream.text == "Hello wor"


@pytest.mark.parametrize(
    "min_tokens, expected",
    [
        (0, "He"),  # "llo", the 2nd token, stops
        (3, "Hello world, he"),  # the 2nd "llo", the 6th token, stops
        (6, "Hello world, hello again, "),  # then " world", the 10th, completes "wor"
    ],
)
def test_the_first_min_tokens_tokens_end_nothing(
    byte_level: PreTrainedTokenizerBase, min_tokens: int, expected: str
) -> None:
    generated = byte_level.encode("Hello world, hello again, world!")
    llo = byte_level.encode("llo")[0]
    assert [i for i, t in enumerate(generated) if t == llo] == [1, 5]  # the premise
    stream = TextStream(byte_level, [], stop=["wor"], stop_token_ids={llo}, min_tokens=min_tokens)

    deltas = _add_all(stream, generated)

    assert stream.ended and "".join(deltas) + stream.finish() == expected


def test_a_stop_string_that_starts_before_min_tokens_and_ends_after_counts(
    byte_level: PreTrainedTokenizerBase,
) -> None:
    generated = byte_level.encode("Hello world, hello again")
    pieces = _pieces(byte_level, generated)
    n = next(i for i in range(1, len(pieces)) if len(pieces[i]) > 1)  # a piece of 2+ chars
    # A stop string across the boundary: the last char of token n-1's text and the
    # first of token n's.
    stop = pieces[n - 1][-1] + pieces[n][0]
    stream = TextStream(byte_level, [], stop=[stop], min_tokens=n)

    deltas = _add_all(stream, generated)

    assert stream.stopped == stop and stream.num_tokens == n + 1
    assert "".join(deltas) == "".join(pieces[:n])[:-1]


def test_matching_stops_only_past_min_tokens_in_the_matcher() -> None:
    matcher = StopStringMatcher(["ab"])
    assert matcher.feed("xab", match=False) == "xab"  # passed: not held back either
    assert matcher.feed("a", match=False) == ""  # "a" may still become "ab"
    assert matcher.feed("b") == "" and matcher.stopped == "ab"


# --- The real SmolLM2 tokenizer (skipped when it has not been fetched) ----------------


def test_smollm2_multibyte_text_streams_exactly(smollm2: PreTrainedTokenizerBase) -> None:
    text = "Voilà: héllo wörld, 日本語のテキスト 🙂🚀 — done."
    generated = smollm2.encode(text, add_special_tokens=False)
    stream = TextStream(smollm2, _chat_prompt(smollm2))

    deltas = _add_all(stream, generated)

    assert not any("\ufffd" in delta for delta in deltas)
    assert "".join(deltas) + stream.finish() == smollm2.decode(generated) == text


def test_smollm2_stop_string_spanning_tokens_cuts_exactly(smollm2: PreTrainedTokenizerBase) -> None:
    text = "The capital of France is Paris. The capital of Japan is Tokyo."
    generated = smollm2.encode(text, add_special_tokens=False)
    stream = TextStream(smollm2, _chat_prompt(smollm2), stop=["is Tok", "Berlin"])

    deltas = _add_all(stream, generated)

    assert stream.stopped == "is Tok"
    assert "".join(deltas) == "The capital of France is Paris. The capital of Japan "
