"""Prompt-lookup (n-gram) drafter: training-free; strong where outputs repeat their context
(GSM8K answers restate the question)."""

from __future__ import annotations

from kdaserve.speculative.drafter import TokenDrafter

SEARCH_WINDOW = 2048  # tokens of history searched, so proposing stays cheap


class NgramDrafter(TokenDrafter):
    def __init__(self, num_draft_tokens: int, max_n: int = 4, min_n: int = 1) -> None:
        if num_draft_tokens < 1:
            raise ValueError(f"speculative_num_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.k, self.max_n, self.min_n = num_draft_tokens, max_n, min_n

    def propose_ids(self, ids: list[int], k: int | None = None) -> list[int]:
        """The k tokens that followed the most recent earlier occurrence of the longest
        suffix n-gram of ids (n from max_n down to min_n); [] when none recurs."""
        k = self.k if k is None else k
        hist = ids[-SEARCH_WINDOW:]
        for n in range(min(self.max_n, len(hist) - 1), self.min_n - 1, -1):
            tail = hist[-n:]
            for i in range(len(hist) - n - 1, -1, -1):
                if hist[i:i + n] == tail:
                    return hist[i + n:i + n + k]
        return []
