"""Incremental detokenization and stop strings.

Tokens are byte sequences: a multi-byte UTF-8 character may be split across tokens, so text is
only emitted up to the last complete character and the incomplete tail waits for the next token.
Stop strings are searched in the text, so they are found even when they span token boundaries;
the output is cut right before the stop string.
"""

from __future__ import annotations

from kdaserve.tokenizer import Tokenizer


def complete_utf8_prefix(data: bytes) -> int:
    """Length of the longest prefix of data that does not end inside a UTF-8 character."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # continuation byte: keep looking for the lead byte
            continue
        if byte & 0x80 == 0:  # ASCII
            return len(data)
        size = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4
        return len(data) if back >= size else len(data) - back
    return len(data)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str], skip_special_tokens: bool,
                 keep_special_ids: tuple[int, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.keep = frozenset(keep_special_ids)  # special tokens parsers need in the text
        self.text = ""
        self._pending = b""
        self._max_stop = max((len(s) for s in stop), default=0)

    def add(self, token_id: int) -> str | None:
        """Appends one token; returns the stop string if the text now contains one (the text is
        then cut right before it)."""
        skip = self.skip_special_tokens and token_id not in self.keep
        self._pending += self.tokenizer.token_bytes(token_id, skip)
        # ending in ASCII, the bytes are whole characters (most tokens: no scan)
        cut = len(self._pending) if self._pending and self._pending[-1] < 0x80 \
            else complete_utf8_prefix(self._pending)
        if cut == 0:
            return None
        old_len = len(self.text)
        self.text += self._pending[:cut].decode("utf-8", errors="replace")
        self._pending = self._pending[cut:]
        if not self.stop:
            return None
        # a stop string ending in the new text may start up to len(stop)-1 chars earlier
        start = max(0, old_len - self._max_stop + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        self._pending = b""
        return best[1]

    def visible_text(self, finished: bool) -> str:
        """Text safe to show a streaming client: while running, the last len(stop)-1
        characters are held back, since they may turn out to be the start of a stop string
        (which is then cut, and a client could not take it back)."""
        if finished or self._max_stop <= 1:
            return self.text
        return self.text[: max(0, len(self.text) - (self._max_stop - 1))]

    def flush(self) -> None:
        """At the end of a request: an incomplete trailing character becomes U+FFFD."""
        if self._pending:
            self.text += self._pending.decode("utf-8", errors="replace")
            self._pending = b""
