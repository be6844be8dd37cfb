"""Tokenizer: Kimi tiktoken format (written from bundled cl100k ranks) and HF tokenizer.json."""

from __future__ import annotations

import base64
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import tiktoken

from kdaserve.tokenizer import KIMI_PAT_STR, Tokenizer, _split_for_tiktoken
from kdaserve.tokenizer_writer import (
    _byte_level_bpe,
    write_hf_tokenizer_json,
    write_kimi_tokenizer,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizer

SMALL_BASE = 4096
FULL_BASE = 100_256  # every cl100k_base rank

# Copied from `TikTokenTokenizer.pat_str` in moonshotai's tokenization_kimi.py, independent of the
# module's constant so a typo there is caught.
KIMI_SOURCE_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

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


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("kimi_small")
    write_kimi_tokenizer(out_dir, SMALL_BASE)
    return out_dir


def _num_base(tok: Tokenizer) -> int:
    return tok.vocab_size - 256


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
    assert ids and all(0 <= i < _num_base(kimi) for i in ids)
    assert kimi.decode(ids) == text
    assert kimi.decode_bytes(ids) == text.encode("utf-8")


def test_vocab_and_special_ids(kimi: Tokenizer) -> None:
    nb = _num_base(kimi)
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
    nb = _num_base(kimi)
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
    nb = _num_base(kimi)
    text = f"[BOS]<|im_assistant|>assistant<|im_middle|>ok{call}<|im_end|>"
    ids = [*kimi.encode(text), nb + 200]  # plus an unnamed reserved id
    assert kimi.decode(ids) == text + f"<|reserved_token_{nb + 200}|>"
    assert kimi.decode(ids, skip_special_tokens=True) == "assistantok" + call
    assert kimi.decode_bytes(ids, skip_special_tokens=True) == ("assistantok" + call).encode()


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
    if _num_base(kimi) == FULL_BASE:
        assert pieces == ["123", "456", "7"]
        assert [kimi.decode([i]) for i in kimi.encode("12345")] == ["123", "45"]
    # Han runs are their own pieces: no token mixes Latin letters and Han bytes.
    for i in kimi.encode("abc你好def"):
        piece = kimi.decode_bytes([i])
        assert not (any(65 <= b < 123 for b in piece) and any(b >= 0x80 for b in piece))
    out_dir = tmp_path_factory.mktemp("ref")
    write_kimi_tokenizer(out_dir, _num_base(kimi))
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


# --- HF tokenizer.json twin of the Kimi tiktoken tokenizer ---

# One sample per kind of text the two encoders could split differently.
TWIN_TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It costs $3.50, OK?",
    "code": (
        'def f(x: int) -> int:\n    """Doc."""\n    return x ** 2  # sq\n\n'
        "\tif a&&b || c != d {}"
    ),
    "han": "你好，世界！今天天气很好。Kimi说：中文和English混排123。",
    "emoji": "🦀🚀 👍🏽 👨‍👩‍👧 🇯🇵 ❤️‍🔥",
    "digits": "1 12 123 1234 12345 1234567890 3.14159 ١٢٣٤٥ １２３４",
    "whitespace": "a  b   c\n\n\n  d\r\n\r\n\t\t e \u3000\u3000f\u00a0 \n   ",
    "contractions": "I'm you're he's we've they'll I'd can't DON'T WE'LL It'S ſ'S",
    "specials": (
        "[BOS]<|im_system|>system<|im_middle|>hi<|im_end|><|im_user|>q<|im_end|>"
        "<|tool_calls_section_begin|><|tool_call_begin|>f:0<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_calls_section_end|>[EOS][EOT]<|im_end|"
    ),
    "mixed": 'Kimi说："Hello 世界" — café naïve ÜBER ǅemo 123abc 🦀\n\n  end',
}


Twin = tuple[Path, Tokenizer, "HFTokenizer"]


@pytest.fixture(scope="module")
def make_twin(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Twin]:
    """Builds, once per size, a folder with both formats for one vocabulary, its tiktoken
    Tokenizer, and the raw `tokenizers.Tokenizer` of its tokenizer.json (not our wrapper, so HF
    itself is tested)."""
    from tokenizers import Tokenizer as HFTokenizer

    built: dict[int, Twin] = {}

    def make(num_base: int) -> Twin:
        if num_base not in built:
            out_dir = tmp_path_factory.mktemp(f"twin{num_base}")
            write_kimi_tokenizer(out_dir, num_base)
            path = write_hf_tokenizer_json(out_dir, num_base)
            assert path == out_dir / "tokenizer.json"
            hf = HFTokenizer.from_file(str(path))
            built[num_base] = (out_dir, Tokenizer.from_pretrained(out_dir), hf)
        return built[num_base]

    return make


@pytest.fixture(params=[SMALL_BASE, FULL_BASE], ids=["small", "full"])
def twin(request: pytest.FixtureRequest, make_twin: Callable[[int], Twin]) -> Twin:
    return make_twin(request.param)


def _with_reserved(text: str, tok: Tokenizer) -> str:
    return text + f"x<|reserved_token_{_num_base(tok) + 100}|>y"


@pytest.mark.parametrize("name", sorted(TWIN_TEXTS))
def test_hf_json_encodes_like_tiktoken(
    twin: Twin, name: str
) -> None:
    _, kimi, hf = twin
    text = _with_reserved(TWIN_TEXTS[name], kimi)
    ids = hf.encode(text, add_special_tokens=False).ids
    assert ids == kimi.encode(text)
    assert hf.decode(ids, skip_special_tokens=False) == text
    assert hf.decode(ids, skip_special_tokens=True) == kimi.decode(ids, skip_special_tokens=True)


def test_hf_json_random_text(twin: Twin) -> None:
    _, kimi, hf = twin
    rng = random.Random(0)
    # Weighted toward the classes the pattern distinguishes: letters of each case, Han, digits
    # (incl. non-ASCII), marks, whitespace kinds, punctuation, apostrophes, emoji parts.
    pool = [
        *"aAzZ  '''sStTdDmMlLrReEvV\n\n\r\t.,!?-_&|()[]{}<>#$%0123456789",
        *"éÉßǅſİıΣσЖж你好世界々〇\u3000\u00a0\u2028\u0301\u200d👍🏽🦀١٢",
    ]
    texts = ["".join(rng.choices(pool, k=rng.randint(1, 40))) for _ in range(500)]
    got = [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
    assert got == [kimi.encode(t) for t in texts]


def test_hf_json_every_code_point(make_twin: Callable[[int], Twin]) -> None:
    """Every code point below U+20000 in letter, space+digit and Han contexts: catches Unicode
    class differences between Oniguruma (HF) and fancy-regex (tiktoken). Full vocab only: its
    multi-byte tokens are what make a misplaced split change the ids."""
    _, kimi, hf = make_twin(FULL_BASE)
    cps = [c for c in range(0x20000) if not 0xD800 <= c < 0xE000]
    for start in range(0, len(cps), 8192):  # well under MAX_ENCODE_CHARS per encode call
        text = "".join(f"a{chr(c)}b {chr(c)}1\u4e00{chr(c)}\n" for c in cps[start : start + 8192])
        assert hf.encode(text, add_special_tokens=False).ids == kimi.encode(text), hex(start)


def test_hf_json_vocab_and_added_tokens(twin: Twin) -> None:
    out_dir, kimi, hf = twin
    nb = _num_base(kimi)
    assert hf.get_vocab_size(with_added_tokens=True) == kimi.vocab_size == nb + 256
    config = json.loads((out_dir / "tokenizer_config.json").read_text())
    added = hf.get_added_tokens_decoder()
    assert {str(i): (t.content, t.special) for i, t in added.items()} == {
        i: (e["content"], e["special"]) for i, e in config["added_tokens_decoder"].items()
    }
    assert not any(t.normalized or t.lstrip or t.rstrip for t in added.values())
    assert hf.token_to_id("Ġthe") == kimi.encode(" the")[0]  # GPT-2 byte spelling of " the"
    data = json.loads((out_dir / "tokenizer.json").read_text())
    assert data["model"]["type"] == "BPE" and data["model"]["ignore_merges"] is True
    assert len(data["model"]["merges"]) == nb - 256  # one per multi-byte token
    split, byte_level = data["pre_tokenizer"]["pretokenizers"]
    assert split["pattern"] == {"Regex": KIMI_SOURCE_PAT_STR}  # used unchanged
    assert split["behavior"] == "Isolated" and byte_level["use_regex"] is False
    assert data["decoder"]["type"] == "ByteLevel" and data["post_processor"] is None


def test_from_pretrained_hf_json_only(
    twin: Twin, tmp_path: Path
) -> None:
    out_dir, kimi, _ = twin
    (tmp_path / "tokenizer.json").write_bytes((out_dir / "tokenizer.json").read_bytes())
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.vocab_size == kimi.vocab_size and tok.special_tokens == kimi.special_tokens
    assert tok.eos_token_ids == kimi.eos_token_ids  # [<|im_end|>, [EOS]] even with no config
    for text in TWIN_TEXTS.values():
        ids = tok.encode(text)
        assert ids == kimi.encode(text)
        assert tok.decode(ids) == kimi.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=True) == kimi.decode(
            ids, skip_special_tokens=True
        )
        assert [tok.decode_bytes([i]) for i in ids] == [kimi.decode_bytes([i]) for i in ids]


def test_tiktoken_preferred_over_hf_json(small_dir: Path, tmp_path: Path) -> None:
    for name in ("tiktoken.model", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((small_dir / name).read_bytes())
    (tmp_path / "tokenizer.json").write_text("not json")  # would fail if it were read
    assert Tokenizer.from_pretrained(tmp_path).vocab_size == SMALL_BASE + 256


def test_transformers_loads_hf_json(make_twin: Callable[[int], Twin]) -> None:
    """llama.cpp's converter reaches tokenizer.json through transformers' AutoTokenizer (the
    loader plumbing does not depend on vocab size, so the small one suffices)."""
    transformers = pytest.importorskip("transformers")
    out_dir, kimi, _ = make_twin(SMALL_BASE)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out_dir / "tokenizer.json"))
    # The folder's tokenizer_config.json names Kimi's remote-code "TikTokenTokenizer" with no
    # auto_map; transformers 5 falls back to its fast backend (4.x would raise, see
    # write_kimi_tokenizer).
    auto = transformers.AutoTokenizer.from_pretrained(str(out_dir))
    assert auto.is_fast
    assert (auto.bos_token, auto.eos_token) == ("[BOS]", "<|im_end|>")
    for text in TWIN_TEXTS.values():
        ids = kimi.encode(text)
        assert fast.encode(text, add_special_tokens=False) == ids
        assert auto.encode(text, add_special_tokens=False) == ids
        assert auto.decode(ids) == text


def test_hf_json_rejects_bad_sizes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_base_tokens=255"):
        write_hf_tokenizer_json(tmp_path, 255)
    assert not (tmp_path / "tokenizer.json").exists()


def test_byte_level_bpe_needs_two_part_merges() -> None:
    # b"abc" with neither b"ab" nor b"bc" in the vocab cannot come from one merge, so no merge
    # list makes HF emit it from "abcabc"; the builder must refuse rather than diverge.
    tokens = [bytes([b]) for b in range(256)] + [b"abc"]
    with pytest.raises(ValueError, match="not the merge of two"):
        _byte_level_bpe(tokens, [])


def test_make_checkpoint_writes_hf_json(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as HFTokenizer

    from kdaserve.checkpoint import make_checkpoint

    out = make_checkpoint(tmp_path / "ckpt", "tiny")
    vocab_size = json.loads((out / "config.json").read_text())["vocab_size"]
    hf = HFTokenizer.from_file(str(out / "tokenizer.json"))
    kimi = Tokenizer.from_pretrained(out)
    assert hf.get_vocab_size(with_added_tokens=True) == kimi.vocab_size == vocab_size
    text = TWIN_TEXTS["mixed"] + TWIN_TEXTS["specials"]
    assert hf.encode(text, add_special_tokens=False).ids == kimi.encode(text)
