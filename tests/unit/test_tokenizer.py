"""Tokenizer: Kimi tiktoken format (written from bundled cl100k ranks) and HF tokenizer.json."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import tiktoken

from kdaserve.tokenizer import KIMI_PAT_STR, Tokenizer, _split_for_tiktoken
from kdaserve.tokenizer_writer import (
    write_kimi_tokenizer,
)

from .tokenizer_helpers import FULL_BASE, KIMI_SOURCE_PAT_STR, SMALL_BASE, num_base

TEXTS = {
    "ascii": "Hello, world! It's 2025; we'll test 12345 tokens.\n\tIndented  line\r\n",
    "han": "你好，世界！今天天气很好。",
    "emoji": "🦀🚀 👍🏽 👨‍👩‍👧",
    "mixed": 'Kimi说："Hello 世界" — café naïve ÜBER 123abc 🦀\n\n  end',
}


@pytest.fixture(scope="module", params=[SMALL_BASE, FULL_BASE], ids=["small", "full"])
def kimi(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    out_dir = tmp_path_factory.mktemp(f"kimi{request.param}")
    assert write_kimi_tokenizer(out_dir, request.param) == request.param + 256
    return Tokenizer.from_pretrained(out_dir)


def _reference_encoding(folder: Path) -> tiktoken.Encoding:
    """A tiktoken Encoding built here, independently, from the written ranks + Kimi's pattern."""
    ranks = {}
    for line in (folder / "tiktoken.model").read_bytes().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return tiktoken.Encoding(
        name="reference", pat_str=KIMI_SOURCE_PAT_STR, mergeable_ranks=ranks, special_tokens={}
    )


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_round_trip(kimi: Tokenizer, name: str) -> None:
    text = TEXTS[name]
    ids = kimi.encode(text)
    assert ids and all(0 <= i < num_base(kimi) for i in ids)
    assert kimi.decode(ids) == text
    assert kimi.decode_bytes(ids) == text.encode("utf-8")


def test_vocab_and_special_ids(kimi: Tokenizer) -> None:
    nb = num_base(kimi)
    special = kimi.special_tokens
    assert len(special) == 256 and set(special.values()) == set(range(nb, nb + 256))
    assert special["[BOS]"] == nb and special["[EOS]"] == nb + 1
    assert special["<|im_end|>"] == nb + 2 and special["<|im_middle|>"] == nb + 17
    assert special["<|tool_call_begin|>"] == nb + 13
    assert special["[UNK]"] == nb + 254 and special["[PAD]"] == nb + 255
    assert kimi.token_to_id(f"<|reserved_token_{nb + 5}|>") == nb + 5
    assert kimi.token_to_id("<|im_user|>") == nb + 3
    assert kimi.token_to_id("a") == ord("a") - ord("!")  # cl100k: byte tokens in GPT-2 order
    assert kimi.token_to_id("definitely-not-one-token-xyz") is None
    assert kimi.bos_token_id == nb
    assert kimi.eos_token_ids == [nb + 2, nb + 1]  # config eos <|im_end|>, then [EOS]


def test_special_tokens_in_text(kimi: Tokenizer) -> None:
    nb = num_base(kimi)
    ids = kimi.encode("<|im_user|>user<|im_middle|>hi<|im_end|>")
    assert ids[0] == nb + 3 and ids[-1] == nb + 2
    assert nb + 17 in ids
    assert kimi.encode(f"x<|reserved_token_{nb + 100}|>") == [*kimi.encode("x"), nb + 100]
    # A near-miss is ordinary text.
    assert all(i < nb for i in kimi.encode("<|im_end|"))


def test_skip_special_tokens_keeps_tool_markers(kimi: Tokenizer) -> None:
    call = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get:0"
        '<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|><|tool_calls_section_end|>'
    )
    nb = num_base(kimi)
    text = f"[BOS]<|im_assistant|>assistant<|im_middle|>ok{call}<|im_end|>"
    ids = [*kimi.encode(text), nb + 200]  # plus an unnamed reserved id
    assert kimi.decode(ids) == text + f"<|reserved_token_{nb + 200}|>"
    assert kimi.decode(ids, skip_special_tokens=True) == "assistantok" + call
    assert kimi.decode_bytes(ids, skip_special_tokens=True) == ("assistantok" + call).encode()


def test_token_bytes_equal_decode_bytes(kimi: Tokenizer) -> None:
    """The detokenizer's cached per-token bytes: those of `decode_bytes([id])` for base and
    special ids, skipped or kept, asked twice (the second from the cache); an id outside the
    vocabulary is refused, not cached."""
    nb = num_base(kimi)
    ids = [*range(0, nb, max(1, nb // 500)), nb - 1, *range(nb, kimi.vocab_size)]
    for skip in (False, True, False):
        for i in ids:
            assert kimi.token_bytes(i, skip) == kimi.decode_bytes([i], skip), (i, skip)
    assert kimi.token_bytes(nb, skip_special_tokens=True) == b""
    with pytest.raises(ValueError, match="outside vocab"):
        kimi.token_bytes(kimi.vocab_size)
    with pytest.raises(ValueError, match="outside vocab"):
        kimi.token_bytes(kimi.vocab_size)


def test_decode_bytes_reassembles_split_char(small_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(small_dir)
    text = "🦀"  # 4 UTF-8 bytes; the 4096-rank vocab has no token for it
    ids = tok.encode(text)
    assert len(ids) >= 2
    first = tok.decode_bytes(ids[:1])
    with pytest.raises(UnicodeDecodeError):
        first.decode("utf-8")
    assert tok.decode(ids[:1]) == "\ufffd" * len(first)  # lossy text, hence decode_bytes
    assert b"".join(tok.decode_bytes([i]) for i in ids) == text.encode("utf-8")


def test_split_pattern_matches_kimi(
    kimi: Tokenizer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    assert KIMI_PAT_STR == KIMI_SOURCE_PAT_STR
    # Digits group in runs of at most three: a token boundary after "123" whatever the vocab.
    pieces = [kimi.decode([i]) for i in kimi.encode("1234567")]
    assert "".join(pieces) == "1234567"
    assert {3, 6} <= {len("".join(pieces[:n])) for n in range(len(pieces) + 1)}
    if num_base(kimi) == FULL_BASE:
        assert pieces == ["123", "456", "7"]
        assert [kimi.decode([i]) for i in kimi.encode("12345")] == ["123", "45"]
    # Han runs are their own pieces: no token mixes Latin letters and Han bytes.
    for i in kimi.encode("abc你好def"):
        piece = kimi.decode_bytes([i])
        assert not (any(65 <= b < 123 for b in piece) and any(b >= 0x80 for b in piece))
    out_dir = tmp_path_factory.mktemp("ref")
    write_kimi_tokenizer(out_dir, num_base(kimi))
    reference = _reference_encoding(out_dir)
    samples = [*TEXTS.values(), "I'LL DON'T you're", "x  \n\n  y\r\n", "a1234567b", "  leading"]
    for text in samples:
        assert kimi.encode(text) == reference.encode_ordinary(text), text


def _kimi_split_reference(text: str) -> Iterator[str]:
    """Kimi's char-by-char `_split_whitespaces_or_nonwhitespaces` inside 400k-char pieces."""
    for start in range(0, len(text), 400_000):
        s = text[start : start + 400_000]
        run_len, run_is_space, slice_start = 0, s[0].isspace() if s else False, 0
        for i, char in enumerate(s):
            if run_is_space ^ char.isspace():
                run_len, run_is_space = 1, char.isspace()
            else:
                run_len += 1
                if run_len > 25_000:
                    yield s[slice_start:i]
                    slice_start, run_len = i, 1
        yield s[slice_start:]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "short text",
        "a" * 25_000,
        "a" * 25_001,
        "a" * 50_001 + " " * 30_000 + "b",
        " b" * 10 + "\u3000" * 25_002 + "c" * 75_000,
        ("word " * 90_000)[:450_000],
        "x" * 410_000,
    ],
    ids=[
        "empty",
        "short",
        "run25k",
        "run25k+1",
        "runs",
        "unicode-space",
        "over400k",
        "long-run400k",
    ],
)
def test_long_text_split_matches_kimi(text: str) -> None:
    assert list(_split_for_tiktoken(text)) == list(_kimi_split_reference(text))


def test_long_run_encodes(small_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(small_dir)
    text = "ab" * 30_000 + " end"
    reference = _reference_encoding(small_dir)
    expected = [
        i for piece in _kimi_split_reference(text) for i in reference.encode_ordinary(piece)
    ]
    assert tok.encode(text) == expected
    assert tok.decode(expected) == text


def test_write_rejects_bad_sizes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_base_tokens=255"):
        write_kimi_tokenizer(tmp_path, 255)
    with pytest.raises(ValueError, match="num_base_tokens=100257"):
        write_kimi_tokenizer(tmp_path, FULL_BASE + 1)


def test_written_config(small_dir: Path) -> None:
    config = json.loads((small_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "TikTokenTokenizer"
    assert (config["bos_token"], config["eos_token"]) == ("[BOS]", "<|im_end|>")
    assert (config["pad_token"], config["unk_token"]) == ("[PAD]", "[UNK]")
    assert "chat_template" not in config
    decoder = config["added_tokens_decoder"]
    assert len(decoder) == 256
    assert decoder[str(SMALL_BASE + 15)] == {
        "content": "<|tool_call_end|>",
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": False,
    }
    assert decoder[str(SMALL_BASE + 5)]["content"] == f"<|reserved_token_{SMALL_BASE + 5}|>"
    assert decoder[str(SMALL_BASE + 5)]["special"] is True


def test_missing_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nope")


def test_bad_files_error(tmp_path: Path) -> None:
    (tmp_path / "tiktoken.model").write_bytes(b"YQ== 0\nYg== 2\n")
    with pytest.raises(ValueError, match="not exactly"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tiktoken.model").write_bytes(b"YQ== 0\nnot-a-line\n")
    with pytest.raises(ValueError, match="bad line 2"):
        Tokenizer.from_pretrained(tmp_path)


def test_decode_rejects_out_of_vocab(small_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(small_dir)
    with pytest.raises(ValueError, match=str(tok.vocab_size)):
        tok.decode([1, tok.vocab_size])


# --- plain HF tokenizer.json ---


def _save_hf(folder: Path, byte_level: bool) -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    specials = ["<|im_end|>", "<s>"]
    if byte_level:
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    else:
        hf = HFTokenizer(models.WordLevel(unk_token="[UNK]"))
        hf.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.WordLevelTrainer(
            special_tokens=["[UNK]", *specials], show_progress=False
        )
    hf.train_from_iterator(["hello world", "the quick brown fox", *TEXTS.values()] * 3, trainer)
    hf.add_tokens(["<tool>"])  # an added token that is not special
    hf.save(str(folder / "tokenizer.json"))
    config = {"eos_token": {"content": "<|im_end|>", "special": True}, "bos_token": "<s>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def test_hf_byte_level(tmp_path: Path) -> None:
    _save_hf(tmp_path, byte_level=True)
    tok = Tokenizer.from_pretrained(tmp_path)
    for text in TEXTS.values():
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.decode_bytes(ids) == text.encode("utf-8")
    special = tok.special_tokens
    im_end, bos, tool = special["<|im_end|>"], special["<s>"], special["<tool>"]
    assert set(special) == {"<|im_end|>", "<s>", "<tool>"}
    assert tok.token_to_id("<tool>") == tool
    assert tok.eos_token_ids == [im_end] and tok.bos_token_id == bos
    assert tok.vocab_size == tool + 1  # the added token comes last
    ids = tok.encode("<s>hi<tool>x<|im_end|>")
    assert ids[0] == bos and ids[-1] == im_end and tool in ids
    assert tok.decode(ids, skip_special_tokens=True) == "hi<tool>x"
    # A multi-byte char split over byte-level tokens reassembles from bytes.
    ids = tok.encode("👨‍👩‍👧")
    assert len(ids) >= 2
    assert b"".join(tok.decode_bytes([i]) for i in ids) == "👨‍👩‍👧".encode()


def test_hf_word_level(tmp_path: Path) -> None:
    _save_hf(tmp_path, byte_level=False)
    tok = Tokenizer.from_pretrained(tmp_path)
    ids = tok.encode("hello world")
    assert tok.decode(ids) == "hello world"
    assert tok.decode_bytes(ids) == b"hello world"
    assert tok.eos_token_ids == [tok.special_tokens["<|im_end|>"]]
    assert tok.special_tokens["[UNK]"] == 0


def test_kimi_format_preferred(small_dir: Path, tmp_path: Path) -> None:
    for name in ("tiktoken.model", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((small_dir / name).read_bytes())
    _save_hf(tmp_path, byte_level=False)  # overwrites the config, keeps tiktoken.model
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.vocab_size == SMALL_BASE + 256


def test_k3_checkpoints_get_k3s_special_ids(tmp_path: Path) -> None:
    """make-checkpoint --preset k3-*: K3's layout of the reserved ids (k3_spec.md 6.2) in the
    tiktoken config and the tokenizer.json twin, `<|end_of_msg|>` the stop token; with the
    real Kimi ranks (../shared/kimi), the released ids themselves."""
    from kdaserve.checkpoint import make_checkpoint

    want = {"[BOS]": 0, "[EOS]": 1, "<|end_of_msg|>": 2, "<|open|>": 3, "<|close|>": 4,
            "<|sep|>": 5, "<|MASK|>": 8, "[EOT]": 9, "<|media_begin|>": 18,
            "<|media_content|>": 19, "<|media_end|>": 20, "<|media_pad|>": 21,
            "<osagent_mode>": 65, "[UNK]": 254, "[PAD]": 255}
    path = make_checkpoint(tmp_path / "k3", "k3-tiny", seed=0)
    hf_only = tmp_path / "hf"
    hf_only.mkdir()
    (hf_only / "tokenizer.json").write_bytes((path / "tokenizer.json").read_bytes())
    for folder in (path, hf_only):
        tok = Tokenizer.from_pretrained(folder)
        base = tok.vocab_size - 256
        assert {n: tok.special_tokens[n] - base for n in want} == want
        assert "<|im_end|>" not in tok.special_tokens
    assert Tokenizer.from_pretrained(path).eos_token_ids[0] == base + 2
    kimi = Path(__file__).resolve().parents[3] / "shared" / "kimi" / "tokenizer"
    if (kimi / "tiktoken.model").is_file():
        real = Tokenizer.from_pretrained(make_checkpoint(tmp_path / "real", "k3-tiny",
                                                         tokenizer=kimi))
        assert {n: real.special_tokens[n] for n in want} == {n: 163584 + o
                                                              for n, o in want.items()}
        assert real.eos_token_ids[0] == 163586
