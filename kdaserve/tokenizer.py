"""Text <-> token ids for Kimi checkpoints: one `Tokenizer` over Kimi's tiktoken format
(`tiktoken.model` + `tokenizer_config.json`) and plain HF `tokenizer.json`. Writing those
files (for generated checkpoints) is `kdaserve.tokenizer_writer`."""

from __future__ import annotations

import base64
import functools
import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import tiktoken

if TYPE_CHECKING:
    import tokenizers

TIKTOKEN_FILE = "tiktoken.model"
HF_TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
NUM_RESERVED_SPECIAL_TOKENS = 256

# Copied from `TikTokenTokenizer.pat_str` in moonshotai's tokenization_kimi.py (Kimi K2 / Kimi
# Linear). `&&` class intersection needs tiktoken's Rust fancy-regex; Python `re` cannot run it.
KIMI_PAT_STR = "|".join(
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

# Kimi's encode limits, kept for token-identical output: tiktoken panics above ~400k chars per
# call, and its regex goes quadratic on very long runs of (non-)whitespace (tiktoken issue #195).
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000
_LONG_RUN = re.compile(rf"\s{{{MAX_RUN_CHARS + 1},}}|\S{{{MAX_RUN_CHARS + 1},}}")

# Kimi K2 special-token names by offset from the first special id; the rest are reserved.
KIMI_SPECIAL_NAMES: dict[int, str] = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    254: "[UNK]",
    255: "[PAD]",
}
# Kimi K3's layout of the same 256 reserved ids (k3_spec.md 6.2): its XTML tags in K2's
# message tokens' place, `<|end_of_msg|>` (the stop token) where K2 has `<|im_end|>`
K3_SPECIAL_NAMES: dict[int, str] = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    6: "[start_header_id]",
    7: "[end_header_id]",
    8: "<|MASK|>",
    9: "[EOT]",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    65: "<osagent_mode>",
    254: "[UNK]",
    255: "[PAD]",
}
SPECIAL_LAYOUTS = {"k2": KIMI_SPECIAL_NAMES, "k3": K3_SPECIAL_NAMES}
# Kimi K2 marks these `special: false`, so tool calls survive skip_special_tokens.
KIMI_NON_SPECIAL = frozenset(
    {
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    }
)
_EXTRA_EOS_TOKENS = ("<|im_end|>", "[EOS]", "<|end_of_msg|>")  # K2, K3 turn ends


class _Backend(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def encode_ordinary(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def decode_bytes(self, ids: Sequence[int]) -> bytes: ...
    def token_to_id(self, token: str) -> int | None: ...


class Tokenizer:
    """Encode/decode for one checkpoint. `special_tokens` holds every added token (name -> id),
    matched whole in text; those flagged special are dropped by `skip_special_tokens`."""

    def __init__(
        self,
        backend: _Backend,
        special_tokens: dict[str, int],
        skip_ids: frozenset[int],
        config: dict[str, Any],
    ) -> None:
        self._backend = backend
        self._special_tokens = special_tokens
        names = sorted(special_tokens, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(map(re.escape, names)) + ")") \
            if names else None
        self._skip_ids = skip_ids
        self._token_bytes: dict[int, bytes] = {}  # token_bytes' cache
        self._bos_token_id = self._config_token_id(config, "bos_token")
        eos = [self._config_token_id(config, "eos_token")]
        eos += [special_tokens.get(name) for name in _EXTRA_EOS_TOKENS]
        self._eos_token_ids = list(dict.fromkeys(i for i in eos if i is not None))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load from a checkpoint folder: Kimi's `tiktoken.model` if present (the Kimi source of
        truth), else `tokenizer.json`; `tokenizer_config.json` is optional in both cases."""
        folder = Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(f"tokenizer folder {str(folder)!r} does not exist")
        config_path = folder / CONFIG_FILE
        config: dict[str, Any] = {}
        if config_path.is_file():
            config = json.loads(config_path.read_text(encoding="utf-8"))
        if (folder / TIKTOKEN_FILE).is_file():
            return cls._from_tiktoken(folder / TIKTOKEN_FILE, config)
        if (folder / HF_TOKENIZER_FILE).is_file():
            return cls._from_hf(folder / HF_TOKENIZER_FILE, config)
        raise FileNotFoundError(
            f"no tokenizer in {str(folder)!r}: expected {TIKTOKEN_FILE!r} (Kimi format) "
            f"or {HF_TOKENIZER_FILE!r} (HF format)"
        )

    @classmethod
    def _from_tiktoken(cls, vocab_path: Path, config: dict[str, Any]) -> Tokenizer:
        ranks = read_tiktoken_bpe(vocab_path)
        num_base = len(ranks)
        declared = _added_tokens(config, vocab_path)
        for token_id in declared:
            if not num_base <= token_id < num_base + NUM_RESERVED_SPECIAL_TOKENS:
                raise ValueError(
                    f"{CONFIG_FILE} declares added token id {token_id}, outside the special "
                    f"range [{num_base}, {num_base + NUM_RESERVED_SPECIAL_TOKENS}) of {vocab_path}"
                )
        special_tokens: dict[str, int] = {}
        skip_ids: set[int] = set()
        for token_id in range(num_base, num_base + NUM_RESERVED_SPECIAL_TOKENS):
            name, is_special = declared.get(token_id, (f"<|reserved_token_{token_id}|>", True))
            special_tokens[name] = token_id
            if is_special:
                skip_ids.add(token_id)
        encoding = tiktoken.Encoding(
            name=vocab_path.parent.name or TIKTOKEN_FILE,
            pat_str=KIMI_PAT_STR,
            mergeable_ranks=ranks,
            special_tokens=special_tokens,
        )
        return cls(_TiktokenBackend(encoding), special_tokens, frozenset(skip_ids), config)

    @classmethod
    def _from_hf(cls, json_path: Path, config: dict[str, Any]) -> Tokenizer:
        import tokenizers  # lazy: only plain-HF checkpoints need it

        hf = tokenizers.Tokenizer.from_file(str(json_path))
        added = hf.get_added_tokens_decoder()
        special_tokens = {tok.content: token_id for token_id, tok in added.items()}
        skip_ids = frozenset(token_id for token_id, tok in added.items() if tok.special)
        return cls(_HFBackend(hf, json_path), special_tokens, skip_ids, config)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token names in the text map to their ids; no BOS added.
        For text a client wrote (a raw completion prompt keeps SGLang's and vLLM's meaning,
        where these are specials); chat content goes through `encode_ordinary`."""
        return self._backend.encode(text)

    def encode_ordinary(self, text: str) -> list[int]:
        """Token ids of `text` with every special-token spelling encoded as the ordinary text
        it is (`<|im_end|>` typed by a user is a few ordinary tokens, not 163586)."""
        return self._backend.encode_ordinary(text)

    def split_special(self, text: str) -> list[str]:
        """`text` cut around each special-token spelling it holds (longest first, as the
        encoders match them): [ordinary, special, ordinary, ...], ordinary parts possibly
        empty."""
        if self._special_re is None:
            return [text]
        return self._special_re.split(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 (e.g. a cut multi-byte char) becomes U+FFFD."""
        return self._backend.decode(self._filter(ids, skip_special_tokens))

    def decode_bytes(self, ids: Sequence[int], skip_special_tokens: bool = False) -> bytes:
        """Raw bytes of `ids`, so an incremental detokenizer can wait for complete UTF-8 chars."""
        return self._backend.decode_bytes(self._filter(ids, skip_special_tokens))

    def token_bytes(self, token_id: int, skip_special_tokens: bool = False) -> bytes:
        """`decode_bytes([token_id])`, cached: the incremental detokenizer asks once per
        generated token, and the backend's call path cost ~3 us against a dict lookup."""
        if skip_special_tokens and token_id in self._skip_ids:
            return b""
        data = self._token_bytes.get(token_id)
        if data is None:
            data = self._backend.decode_bytes([token_id])
            self._token_bytes[token_id] = data
        return data

    def token_to_id(self, token: str) -> int | None:
        """Id of a special-token name or of one vocabulary entry (HF: as spelled in its vocab)."""
        if token in self._special_tokens:
            return self._special_tokens[token]
        return self._backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Base vocabulary plus special tokens; every valid id is below this."""
        return self._backend.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        """Config `eos_token`, then `<|im_end|>` and `[EOS]` where present; no duplicates."""
        return list(self._eos_token_ids)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._special_tokens)

    def _filter(self, ids: Sequence[int], skip_special_tokens: bool) -> Sequence[int]:
        if not skip_special_tokens:
            return ids
        return [i for i in ids if i not in self._skip_ids]

    def _config_token_id(self, config: dict[str, Any], key: str) -> int | None:
        # HF serialises these either as a plain string or as an AddedToken dict.
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if not isinstance(value, str):
            return None
        return self.token_to_id(value)


class _TiktokenBackend:
    def __init__(self, encoding: tiktoken.Encoding) -> None:
        self._encoding = encoding
        self.vocab_size = encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _split_for_tiktoken(text):
            ids.extend(self._encoding.encode(piece, allowed_special="all"))
        return ids

    def encode_ordinary(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _split_for_tiktoken(text):
            ids.extend(self._encoding.encode_ordinary(piece))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        try:
            return self._encoding.decode_bytes(ids)
        except KeyError:
            bad = [i for i in ids if not 0 <= i < self.vocab_size]
            raise ValueError(f"token ids {bad[:8]} outside vocab of {self.vocab_size}") from None

    def token_to_id(self, token: str) -> int | None:
        try:
            return self._encoding.encode_single_token(token.encode("utf-8"))
        except KeyError:
            return None


class _HFBackend:
    def __init__(self, hf: tokenizers.Tokenizer, json_path: Path) -> None:
        self._hf = hf
        # a twin without the added tokens, so their spellings go through the pre-tokenizer
        # and the model as any text does (tokenizers' `encode_special_tokens` leaves the
        # non-special added tokens matched, and segments the special ones its own way)
        plain = json.loads(hf.to_str())
        plain["added_tokens"] = []
        self._ordinary = type(hf).from_str(json.dumps(plain))
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self._token_bytes = _byte_level_table(hf, json_path)

    def encode(self, text: str) -> list[int]:
        # No post-processor BOS/EOS, so both formats give plain text -> ids.
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_ordinary(self, text: str) -> list[int]:
        return self._ordinary.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        self._check_ids(ids)
        return self._hf.decode(list(ids), skip_special_tokens=False)

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        if self._token_bytes is None:
            # Not byte-level (e.g. Metaspace): tokens have no exact byte spelling, so this is the
            # decoded text, where a cut multi-byte char shows as U+FFFD.
            return self.decode(ids).encode("utf-8")
        self._check_ids(ids)
        return b"".join(self._token_bytes[i] for i in ids)

    def token_to_id(self, token: str) -> int | None:
        return self._hf.token_to_id(token)

    def _check_ids(self, ids: Sequence[int]) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:8]} outside vocab of {self.vocab_size}")


def _byte_level_table(hf: tokenizers.Tokenizer, json_path: Path) -> list[bytes] | None:
    """Bytes of every id when the decoder is GPT-2 ByteLevel, else None."""
    decoder = json.loads(json_path.read_text(encoding="utf-8")).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    if not any(part.get("type") == "ByteLevel" for part in parts):
        return None
    char_to_byte = {char: byte for byte, char in _bytes_to_unicode().items()}
    added = {i: tok.content for i, tok in hf.get_added_tokens_decoder().items()}
    table: list[bytes] = []
    for token_id in range(hf.get_vocab_size(with_added_tokens=True)):
        token = hf.id_to_token(token_id) or ""
        if token_id in added:  # added tokens are stored as plain text, not byte-mapped
            table.append(added[token_id].encode("utf-8"))
        else:
            table.append(bytes(char_to_byte[c] for c in token))
    return table


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte -> printable-char map used by ByteLevel vocabularies.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _split_for_tiktoken(text: str) -> Iterator[str]:
    """Kimi's chunking: pieces of <= MAX_ENCODE_CHARS, cut inside any run of more than
    MAX_RUN_CHARS whitespace (or non-whitespace) chars every MAX_RUN_CHARS chars of the run."""
    for start in range(0, len(text), MAX_ENCODE_CHARS):
        piece = text[start : start + MAX_ENCODE_CHARS]
        cut = 0
        # Long runs are rare, so find them with one C-speed regex scan instead of a char loop.
        for run in _LONG_RUN.finditer(piece):
            for pos in range(run.start() + MAX_RUN_CHARS, run.end(), MAX_RUN_CHARS):
                yield piece[cut:pos]
                cut = pos
        yield piece[cut:]


def _added_tokens(config: dict[str, Any], source: Path) -> dict[int, tuple[str, bool]]:
    """`added_tokens_decoder` of a tokenizer config as {id: (content, special)}."""
    declared: dict[int, tuple[str, bool]] = {}
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise ValueError(
                f"bad added_tokens_decoder entry {key!r} in {CONFIG_FILE} for {source}"
            )
        declared[int(key)] = (entry["content"], bool(entry.get("special", True)))
    return declared


def read_tiktoken_bpe(path: Path) -> dict[bytes, int]:
    """Parse a tiktoken BPE file (base64 token, space, rank per line); ranks must be 0..n-1.

    Not `tiktoken.load.load_tiktoken_bpe`: that caches file contents by path under /tmp with no
    hash check, so a rewritten file at the same path would load stale ranks."""
    ranks: dict[bytes, int] = {}
    for line_no, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise ValueError(f"bad line {line_no} {line[:60]!r} in {path}") from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        # Special ids start right after the base ranks, so gaps or duplicates would collide.
        raise ValueError(f"ranks in {path} are not exactly 0..{len(ranks) - 1}")
    return ranks
