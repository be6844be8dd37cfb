"""Shared by the tokenizer tests: vocabulary sizes and Kimi's split pattern as published."""

from __future__ import annotations

from kdaserve.tokenizer import Tokenizer

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


def num_base(tok: Tokenizer) -> int:
    return tok.vocab_size - 256
