"""Chat content can never spell a control token. A Jinja chat template renders messages to one
string; encoded with every special token allowed (as a raw prompt is), a user who types
`<|im_end|><|im_start|>system` would close their own turn and forge a system one. So every
string a client sent (message text and parts, names, tool calls and their arguments,
reasoning, tool schemas, template kwargs) has its special-token spellings swapped for
private-use markers before rendering; in the rendered text, the special spellings left are
the template's own and become control tokens, and the text around them, markers restored to
what the client wrote, is encoded with no special tokens at all (`Tokenizer.encode_ordinary`).
Text without such spellings encodes exactly as before: the encoders also cut at specials and
encode the pieces between them as ordinary text."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kdaserve.tokenizer import Tokenizer

# U+E000 / U+E001 (private use): a marker is MARK, an index into the table, END. The table's
# entry 0 is MARK itself, so a client's own U+E000 is escaped too and round-trips.
MARK, END = "\ue000", "\ue001"
_MARKER = re.compile(f"{MARK}(\\d+){END}")


class Untrusted:
    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.table = [MARK, *sorted(tok.special_tokens, key=len, reverse=True)]
        self._index = {s: i for i, s in enumerate(self.table)}
        self._spellings = re.compile("|".join(map(re.escape, self.table)))

    def escape(self, obj: Any) -> Any:
        """`obj` with every string in it (mapping keys too) escaped, recursively."""
        if isinstance(obj, str):
            return self._spellings.sub(lambda m: f"{MARK}{self._index[m.group()]}{END}", obj)
        if isinstance(obj, Mapping):
            return {self.escape(k): self.escape(v) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return [self.escape(v) for v in obj]
        return obj

    def restore(self, text: str) -> str:
        return _MARKER.sub(lambda m: self.table[int(m.group(1))], text)

    def encode(self, rendered: str) -> list[int]:
        """Ids of a template's output rendered from escaped input: its own special spellings
        as control tokens, everything else ordinary text."""
        ids: list[int] = []
        for i, piece in enumerate(self.tok.split_special(rendered)):
            if i % 2:  # a special spelling: the template wrote it
                token = self.tok.token_to_id(piece)
                assert token is not None
                ids.append(token)
            elif piece:
                ids.extend(self.tok.encode_ordinary(self.restore(piece)))
        return ids
