"""Incremental detokenization: UTF-8 boundaries, stop strings, special tokens, flush.

Uses a real Kimi-format tokenizer with a 4096-token base vocabulary, small enough that Chinese
characters and emoji are split into several byte tokens."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from kdaserve.detokenizer import IncrementalDetokenizer, complete_utf8_prefix
from kdaserve.tokenizer import Tokenizer
from kdaserve.tokenizer_writer import write_kimi_tokenizer

MIXED_TEXT = "Hello 世界! 🎉👍🏽 naïve café — 你好，Kimi。"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path: Path = tmp_path_factory.mktemp("kimi_tok")
    write_kimi_tokenizer(path, 4096)
    return Tokenizer.from_pretrained(path)


def feed(detok: IncrementalDetokenizer, ids: Sequence[int]) -> tuple[list[str], str | None, int]:
    """Adds ids until a stop string hits; returns the text after each add, the stop string and
    how many ids were consumed."""
    texts: list[str] = []
    for i, t in enumerate(ids):
        stop = detok.add(t)
        texts.append(detok.text)
        if stop is not None:
            return texts, stop, i + 1
    return texts, None, len(ids)


def char_boundary_at_or_before(data: bytes, k: int) -> int:
    """Reference: the largest character boundary <= k of valid UTF-8 `data`."""
    while k > 0 and k < len(data) and data[k] & 0xC0 == 0x80:
        k -= 1
    return k


# ---- complete_utf8_prefix ----

@pytest.mark.parametrize(("data", "expected"), [
    (b"", 0),
    (b"abc", 3),
    ("é".encode(), 2),
    ("aé".encode()[:2], 1),  # 2-byte char, lead byte only
    ("a你".encode()[:2], 1),  # 3-byte char, 1 of 3
    ("a你".encode()[:3], 1),  # 3-byte char, 2 of 3
    ("a你".encode(), 4),
    ("a🎉".encode()[:2], 1),  # 4-byte char, 1 of 4
    ("a🎉".encode()[:3], 1),
    ("a🎉".encode()[:4], 1),  # 3 of 4
    ("a🎉".encode(), 5),
    ("你好".encode()[:5], 3),  # complete char, then a split one
    ("🎉é".encode()[:5], 4),
], ids=["empty", "ascii", "2-byte-complete", "2-byte-1of2", "3-byte-1of3", "3-byte-2of3",
        "3-byte-complete", "4-byte-1of4", "4-byte-2of4", "4-byte-3of4", "4-byte-complete",
        "complete-then-split-3", "4-byte-then-split-2"])
def test_complete_utf8_prefix(data: bytes, expected: int) -> None:
    assert complete_utf8_prefix(data) == expected


def test_complete_utf8_prefix_every_cut_of_mixed_text() -> None:
    data = MIXED_TEXT.encode()
    for k in range(len(data) + 1):
        cut = complete_utf8_prefix(data[:k])
        assert cut == char_boundary_at_or_before(data, k), k
        data[:cut].decode("utf-8")  # strict: never a partial character


# ---- streaming text ----

STREAM_TEXTS = {
    "mixed": MIXED_TEXT,
    "chinese": "纯中文的句子，没有英文。",
    "emoji": "🎉🎉👍🏽🇫🇷",
    "ascii": "plain ascii only",
}


@pytest.mark.parametrize("text", list(STREAM_TEXTS.values()), ids=list(STREAM_TEXTS))
def test_streaming_reproduces_text_without_partial_chars(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, stop=[], skip_special_tokens=True)
    texts, stop, _ = feed(detok, ids)
    assert stop is None
    for t in texts:
        assert "\ufffd" not in t
        assert text.startswith(t)
    assert texts == sorted(texts, key=len)  # only ever grows
    detok.flush()
    assert detok.text == text


def test_mixed_text_really_splits_characters_across_tokens(tok: Tokenizer) -> None:
    # guards the test above: with a 4096-token vocabulary, CJK and emoji are byte pieces
    pieces = [tok.decode_bytes([t]) for t in tok.encode(MIXED_TEXT)]
    split = [p for p in pieces if complete_utf8_prefix(p) != len(p)]
    assert len(split) >= 5


# ---- stop strings ----

@pytest.mark.parametrize(("text", "stop"), [
    ("The answer is forty-two. Done.", "ty-tw"),  # " for" "ty" "-t" "wo"
    ("Hello 世界! 你好", "界! 你"),  # starts and ends inside split characters
    ("tea 🎉 party 👍🏽 end", "🎉 pa"),
], ids=["ascii", "chinese", "emoji"])
def test_stop_string_spanning_tokens_cuts_text_before_it(tok: Tokenizer, text: str,
                                                         stop: str) -> None:
    ids = tok.encode(text)
    assert all(stop not in tok.decode([t]) for t in ids), "stop string inside one token"
    start = text.index(stop)
    detok = IncrementalDetokenizer(tok, stop=["never", stop], skip_special_tokens=True)
    texts, hit, consumed = feed(detok, ids)
    assert hit == stop
    assert detok.text == text[:start]  # the stop string itself is excluded
    # detected on the token that completes it, not later
    assert stop in tok.decode(ids[:consumed])
    assert stop not in tok.decode(ids[:consumed - 1])
    assert all(stop not in t for t in texts)
    assert consumed < len(ids)


def test_earliest_stop_string_wins_not_list_order(tok: Tokenizer) -> None:
    ids = tok.encode("hello world")
    assert tok.decode([ids[-1]]) == " world"  # one token completes both stop strings
    detok = IncrementalDetokenizer(tok, stop=["ld", "wor", "zzz"], skip_special_tokens=True)
    _, hit, consumed = feed(detok, ids)
    assert (hit, detok.text, consumed) == ("wor", "hello ", len(ids))


def test_earlier_stop_string_ending_first_wins(tok: Tokenizer) -> None:
    text = "The answer is forty-two. Done."
    detok = IncrementalDetokenizer(tok, stop=["Done", "answer"], skip_special_tokens=True)
    _, hit, consumed = feed(detok, tok.encode(text))
    assert (hit, detok.text) == ("answer", "The ")
    assert consumed == 3  # "The", " an", "swer"


def test_stop_string_at_the_very_start_gives_empty_text(tok: Tokenizer) -> None:
    ids = tok.encode("Stop here")
    detok = IncrementalDetokenizer(tok, stop=["Stop"], skip_special_tokens=True)
    texts, hit, consumed = feed(detok, ids)
    assert (hit, detok.text, consumed) == ("Stop", "", 2)
    assert texts == ["St", ""]


def test_stop_string_with_split_multibyte_char(tok: Tokenizer) -> None:
    # "界" arrives as two byte tokens; the stop is found only once the char is complete
    ids = tok.encode("Hello 世界!")
    detok = IncrementalDetokenizer(tok, stop=["界"], skip_special_tokens=True)
    _, hit, _ = feed(detok, ids)
    assert (hit, detok.text) == ("界", "Hello 世")


# ---- special tokens and flush ----

@pytest.mark.parametrize(("skip", "expected"), [
    (True, "Hi<|tool_call_begin|>there"),
    (False, "Hi<|im_end|><|tool_call_begin|>there"),
], ids=["skip_special_tokens", "keep_special_tokens"])
def test_special_tokens_skipped_or_kept(tok: Tokenizer, skip: bool, expected: str) -> None:
    im_end = tok.special_tokens["<|im_end|>"]  # special: skippable
    tool = tok.special_tokens["<|tool_call_begin|>"]  # not special: always kept
    ids = tok.encode("Hi") + [im_end, tool] + tok.encode("there")
    detok = IncrementalDetokenizer(tok, stop=[], skip_special_tokens=skip)
    feed(detok, ids)
    detok.flush()
    assert detok.text == expected


def test_stop_string_matches_kept_special_token_text(tok: Tokenizer) -> None:
    ids = tok.encode("Hi") + [tok.special_tokens["<|im_end|>"]] + tok.encode("there")
    kept = IncrementalDetokenizer(tok, stop=["<|im_end|>"], skip_special_tokens=False)
    skipped = IncrementalDetokenizer(tok, stop=["<|im_end|>"], skip_special_tokens=True)
    assert feed(kept, ids)[1:] == ("<|im_end|>", 3) and kept.text == "Hi"
    assert feed(skipped, ids)[1] is None and skipped.text == "Hithere"


def test_flush_turns_incomplete_trailing_char_into_replacement(tok: Tokenizer) -> None:
    ids = tok.encode("ab你")
    partial = tok.decode_bytes(ids[:-1])
    assert complete_utf8_prefix(partial) < len(partial)  # "你" spans the last tokens
    detok = IncrementalDetokenizer(tok, stop=[], skip_special_tokens=True)
    feed(detok, ids[:-1])
    assert detok.text == "ab"  # the partial char is held back, not emitted
    detok.flush()
    assert detok.text == "ab\ufffd"
    detok.flush()  # nothing pending: a no-op
    assert detok.text == "ab\ufffd"


def test_flush_after_complete_text_changes_nothing(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, stop=[], skip_special_tokens=True)
    feed(detok, tok.encode("你好"))
    assert detok.text == "你好"
    detok.flush()
    assert detok.text == "你好"


def test_visible_text_holds_back_a_possible_stop_prefix(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    path = tmp_path_factory.mktemp("tok_hold")
    write_kimi_tokenizer(path, 4096)
    tok = Tokenizer.from_pretrained(path)
    detok = IncrementalDetokenizer(tok, ["STOP!"], skip_special_tokens=True)
    shown = []
    for t in tok.encode("hello world ST"):
        detok.add(t)
        shown.append(detok.visible_text(finished=False))
    # never shows the "ST" that could start "STOP!", and every update extends the previous one
    assert all(not s.endswith("ST") for s in shown)
    assert all(b.startswith(a) for a, b in zip(shown, shown[1:], strict=False))
    assert detok.visible_text(finished=True) == "hello world ST"
