"""Incremental detokenizer and stop-string matcher, checked against full decodes and a
character-by-character reference scan."""

from __future__ import annotations

import random

import pytest

from engine.frontend.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from engine.frontend.stop_strings import StopStringMatcher
from tests.helpers.tiny_tokenizer import make_tokenizer

TEXTS = [
    "Hello world, this is a small test.",
    "日本語のテキストです。中文文本测试。",
    "Emoji: 😀 🎉 🚀 👍🏽 family 👨\u200d👩\u200d👧 done",
    "Café naïve résumé — 한국어 텍스트 😀x",
]


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def _stream(
    detok: IncrementalDetokenizer, ids: list[int], chunks: list[int] | None = None
) -> list[str]:
    deltas = []
    pos = 0
    for size in chunks or [1] * len(ids):
        deltas.append(detok.update(ids[pos : pos + size]))
        pos += size
    assert pos == len(ids)
    deltas.append(detok.flush())
    return deltas


def test_tokenizer_splits_multibyte_characters(tok):
    """Precondition for the tests below to mean anything: some single tokens are partial
    UTF-8 and decode to U+FFFD on their own."""
    ids = tok.encode(TEXTS[2], add_special_tokens=False)
    assert any(REPLACEMENT_CHAR in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("use_decode_stream", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_never_broken_and_joins_to_full_decode(tok, text, use_decode_stream):
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("Prompt: "), use_decode_stream=use_decode_stream)
    assert detok.uses_decode_stream is use_decode_stream
    deltas = _stream(detok, ids)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == text
    assert detok.output_token_ids == ids


@pytest.mark.parametrize("use_decode_stream", [True, False])
def test_random_chunk_sizes(tok, use_decode_stream):
    """Several tokens per update (speculative decoding) give the same text."""
    rng = random.Random(0)
    ids = tok.encode(" ".join(TEXTS), add_special_tokens=False)
    for _ in range(5):
        chunks, left = [], len(ids)
        while left:
            chunks.append(min(left, rng.randint(1, 4)))
            left -= chunks[-1]
        detok = IncrementalDetokenizer(tok, tok.encode("x"), use_decode_stream=use_decode_stream)
        deltas = _stream(detok, ids, chunks)
        assert all(REPLACEMENT_CHAR not in d for d in deltas)
        assert "".join(deltas) == tok.decode(ids)


@pytest.mark.parametrize("use_decode_stream", [True, False])
def test_leading_space_token_right_after_prompt(tok, use_decode_stream):
    prompt = tok.encode("Hello")
    ids = tok.encode(" world", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids)[0].startswith("Ġ")  # a leading-space token
    detok = IncrementalDetokenizer(tok, prompt, use_decode_stream=use_decode_stream)
    first = detok.update(ids[:1])
    assert first.startswith(" ")
    assert first + "".join(_stream(detok, ids[1:])) == " world"


@pytest.mark.parametrize("use_decode_stream", [True, False])
def test_prompt_ending_inside_a_character(tok, use_decode_stream):
    """A prompt given as ids that stops mid-emoji: decoding still starts cleanly."""
    emoji_ids = tok.encode("😀 ok", add_special_tokens=False)
    assert REPLACEMENT_CHAR in tok.decode(emoji_ids[:1])
    prompt = tok.encode("abc def ghi") + emoji_ids[:1]
    ids = tok.encode(" and more 🎉", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt, use_decode_stream=use_decode_stream)
    deltas = _stream(detok, ids)
    assert "".join(deltas) == tok.decode(ids)


@pytest.mark.parametrize("use_decode_stream", [True, False])
def test_incomplete_character_at_the_end_is_flushed(tok, use_decode_stream):
    ids = tok.encode("ok 😀", add_special_tokens=False)
    cut = ids[:-1]  # ends inside the emoji
    assert tok.decode(cut).endswith(REPLACEMENT_CHAR)
    detok = IncrementalDetokenizer(tok, tok.encode("p"), use_decode_stream=use_decode_stream)
    streamed = "".join(detok.update([i]) for i in cut)
    assert REPLACEMENT_CHAR not in streamed
    assert streamed + detok.flush() == tok.decode(cut)
    assert detok.flush() == ""


@pytest.mark.parametrize("use_decode_stream", [True, False])
@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip, use_decode_stream):
    ids = (
        tok.encode("Hi there", add_special_tokens=False)
        + [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]
        + tok.encode(" after 日本", add_special_tokens=False)
    )
    detok = IncrementalDetokenizer(
        tok, tok.encode("x"), skip_special_tokens=skip, use_decode_stream=use_decode_stream
    )
    text = "".join(_stream(detok, ids))
    assert text == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in text) is not skip


class _BrokenStream:
    def step(self, tokenizer, ids):
        raise Exception("Invalid prefix encountered")  # what tokenizers raises


def test_decode_stream_failure_falls_back_to_offsets(tok):
    ids = tok.encode(TEXTS[2], add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("p"), use_decode_stream=True)
    deltas = [detok.update([i]) for i in ids[:7]]
    detok._stream = _BrokenStream()  # DecodeStream state corrupted mid-stream
    deltas += _stream(detok, ids[7:])
    assert not detok.uses_decode_stream
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids)


def test_window_algorithm_never_decodes_the_whole_text(tok, monkeypatch):
    ids = tok.encode(" ".join(TEXTS * 3), add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("p"), use_decode_stream=False)
    lengths = []
    real_decode = tok.decode

    def recording_decode(token_ids, **kwargs):
        lengths.append(len(token_ids))
        return real_decode(token_ids, **kwargs)

    monkeypatch.setattr(tok, "decode", recording_decode)
    text = "".join(_stream(detok, ids))
    monkeypatch.undo()
    assert text == tok.decode(ids)
    assert len(ids) > 100 and max(lengths) <= 16


# -- stop strings ---------------------------------------------------------------------------
def _reference_first_stop(text: str, stops: list[str]) -> tuple[str, int] | None:
    """Scan character by character: the first position where some stop string ends."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)  # same end: the one starting earliest
            return stop, end
    return None


def _feed(matcher: StopStringMatcher, chunks: list[str]):
    text = ""
    for chunk in chunks:
        start = len(text)
        text += chunk
        match = matcher.find(text, start)
        if match is not None:
            return match, text
    return None, text


def test_stop_string_spanning_chunks_excluded_and_included():
    chunks = ["Hello wo", "rld. ST", "O", "P and more"]
    excluded, text = _feed(StopStringMatcher(["STOP"], include_in_output=False), chunks)
    assert excluded.stop == "STOP" and text[: excluded.truncate_to] == "Hello world. "
    included, text = _feed(StopStringMatcher(["STOP"], include_in_output=True), chunks)
    assert text[: included.truncate_to] == "Hello world. STOP"


def test_earliest_stop_wins_regardless_of_list_order():
    for stops in (["world", "lo"], ["lo", "world"]):
        match, text = _feed(StopStringMatcher(stops, False), ["Hello world"])
        assert match.stop == "lo" and text[: match.truncate_to] == "Hel"


def test_stop_matching_is_independent_of_chunking():
    rng = random.Random(1)
    alphabet = "ab c日😀"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
            for _ in range(rng.randint(1, 3))
        ]
        include = rng.random() < 0.5
        cuts = (
            sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6))))
            if len(text) > 1
            else []
        )
        chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        match, _ = _feed(StopStringMatcher(stops, include), chunks)
        expected = _reference_first_stop(text, stops)
        if expected is None:
            assert match is None
        else:
            stop, end = expected
            assert match is not None and match.stop == stop
            assert match.truncate_to == (end if include else end - len(stop))


def test_holdback_while_streaming_and_release_at_finish():
    matcher = StopStringMatcher(["</answer>", "STOP"], include_in_output=False)
    assert matcher.holdback == len("</answer>") - 1
    assert matcher.stable_length(20, finished=False) == 20 - 8
    assert matcher.stable_length(5, finished=False) == 0
    assert matcher.stable_length(20, finished=True) == 20
    assert StopStringMatcher(["STOP"], include_in_output=True).holdback == 0


def test_bad_stop_lists_rejected():
    with pytest.raises(ValueError, match="stop strings"):
        StopStringMatcher([""], False)
    with pytest.raises(ValueError, match="stop strings"):
        StopStringMatcher([], False)
