"""The HF tokenizer.json written for the same vocabulary as the Kimi tiktoken files: it encodes
and decodes exactly like them (HF's own `tokenizers`, and transformers, read it)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kdaserve.tokenizer import Tokenizer
from kdaserve.tokenizer_writer import (
    _byte_level_bpe,
    write_hf_tokenizer_json,
    write_kimi_tokenizer,
)

from .tokenizer_helpers import FULL_BASE, KIMI_SOURCE_PAT_STR, SMALL_BASE, num_base

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizer

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
    return text + f"x<|reserved_token_{num_base(tok) + 100}|>y"


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
    nb = num_base(kimi)
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


@pytest.mark.parametrize("name", sorted(TWIN_TEXTS))
def test_encode_ordinary_spells_specials_as_text_in_both_backends(twin: Twin,
                                                                  name: str) -> None:
    """`encode_ordinary` (chat content: server/untrusted.py): a tokenizer.json-only folder
    gives the tiktoken folder's ids, special spellings as ordinary tokens that decode back."""
    from kdaserve.tokenizer import Tokenizer as Ours

    folder, kimi, _ = twin
    text = _with_reserved(TWIN_TEXTS[name], kimi)
    hf_only = folder.parent / f"{folder.name}-hf-only"
    if not hf_only.is_dir():
        hf_only.mkdir()
        (hf_only / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    hf_tok = Ours.from_pretrained(hf_only)
    ids = kimi.encode_ordinary(text)
    assert hf_tok.encode_ordinary(text) == ids
    assert not set(ids) & set(kimi.special_tokens.values())
    assert kimi.decode(ids) == text
