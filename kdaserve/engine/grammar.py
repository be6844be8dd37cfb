"""Structured outputs: a request's `Grammar` compiled by llguidance into a per-request matcher
whose token bitmask is applied to the logits before sampling.

Why llguidance (not xgrammar): it names special tokens in its Lark grammars (`<|tool_call_begin|>`),
so a forced tool call is one grammar in the model's own tool-call format; it computes masks
lazily (no per-grammar precompilation, ~0.05 ms a mask on Kimi's 163k vocabulary), and it pulls
in no other dependency. `kdaserve bench grammar` measures both on our shapes.

A budget: a constrained request must still end in valid output when `max_tokens` runs out
(a random-weight model rarely closes a string by itself). Near the end of the budget each
matcher estimates how many tokens a greedy close takes (`_close_cost`, a simulation on a copy);
once the rest of the budget is no more than that, it forces the closing path token by token:
end-of-sequence when the grammar accepts, then the longest token that spells the start of the
JSON closing suffix (`"}]`, tracked by `JsonCursor`), then separators, then short complete
values, else the shortest token the grammar allows.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from kdaserve.request import Grammar, Request
from kdaserve.tokenizer import Tokenizer

logger = logging.getLogger("kdaserve")

# compact JSON: no free whitespace (a random model fills it with tabs), ", " / ": " become , :
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
CLOSE_MARGIN = 2  # spare tokens kept beyond the estimated closing path
CLOSE_LOOKAHEAD = 256  # longest closing path simulated; longer ones start closing at once
FALLBACK_CANDIDATES = 6  # shortest allowed tokens compared when no closing token is allowed
FALLBACK_LOOKAHEAD = 48  # how far each is simulated
CLOSE_GUARD = 48  # within this many tokens of the close, sampled tokens are checked (`check`)
CLOSE_RECHECK = 8  # re-estimate after this fraction of the slack is used (nesting may grow)
_CLOSERS = set('"}]')
_SHORT_VALUES = ("0", "null", "true", "false", "[]", "{}", '""')


def _close_classes(token_bytes: list[bytes], special: dict[int, str]
                   ) -> tuple[np.ndarray, list[np.ndarray]]:
    """(closer ids, [separator ids, short-value ids]): closers are the tokens made only of
    `"`, `}` and `]`, longest first, plus special tokens that end something."""
    closers, values, seps = [], [], []
    for i, b in enumerate(token_bytes):
        if i in special:
            name = special[i]
            if "end" in name or "close" in name or name.startswith("</"):
                closers.append(i)
            continue
        s = b.decode("utf-8", errors="ignore")
        if s and len(s) == len(b) and set(s) <= _CLOSERS:
            closers.append(i)
        elif s in _SHORT_VALUES:
            values.append(i)
        elif s in (",", ":"):
            seps.append(i)
    closers.sort(key=lambda i: -len(token_bytes[i]) if i not in special else 0)
    order = {v: n for n, v in enumerate(_SHORT_VALUES)}
    values.sort(key=lambda i: order[token_bytes[i].decode()])
    # a separator before a value: after a complete number, "0" would only lengthen it
    return np.array(closers, dtype=np.int64), [np.array(c, dtype=np.int64)
                                               for c in (seps, values)]


class JsonCursor:
    """Where the output is in a JSON text (open brackets, inside a string), enough to spell
    the shortest suffix that closes it. Special tokens reset it (a tool call's arguments start
    after one)."""

    __slots__ = ("stack", "in_string", "escape")

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.in_string = self.escape = False

    def copy(self) -> JsonCursor:
        c = JsonCursor()
        c.stack, c.in_string, c.escape = list(self.stack), self.in_string, self.escape
        return c

    def reset(self) -> None:
        self.stack.clear()
        self.in_string = self.escape = False

    def feed(self, text: str) -> None:
        for ch in text:
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.stack.append("}" if ch == "{" else "]")
            elif ch in "}]" and self.stack:
                self.stack.pop()

    def closing_suffix(self) -> str:
        return ('"' if self.in_string and not self.escape else "") + "".join(reversed(self.stack))


class GrammarBackend:
    """Compiles grammars for one tokenizer and vocabulary; shared by all requests."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: list[int]) -> None:
        import llguidance  # lazy: only constrained requests need it

        self._llg = llguidance
        self.vocab_size = vocab_size
        special = {i: name for name, i in tokenizer.special_tokens.items()}
        token_bytes = [b"" for _ in range(vocab_size)]
        for i in range(min(tokenizer.vocab_size, vocab_size)):
            token_bytes[i] = (b"\xff" + special[i].encode()) if i in special \
                else tokenizer.decode_bytes([i])

        class _Wrapper:  # llguidance's TokenizerWrapper protocol
            eos_token_id = eos_ids[0]
            bos_token_id = None
            tokens = token_bytes
            special_token_ids = sorted(special)
            is_tokenizer_wrapper = True

            def __call__(self, s: bytes | str) -> list[int]:
                return tokenizer.encode(s.decode() if isinstance(s, bytes) else s)

        self.tokenizer = llguidance.LLTokenizer(_Wrapper(), n_vocab=vocab_size,
                                                eos_token=list(eos_ids))
        self.eos_ids = np.array(eos_ids, dtype=np.int64)
        self.token_len = np.array([len(b) if i not in special else 1 << 20
                                   for i, b in enumerate(token_bytes)], dtype=np.int64)
        self.token_len[self.token_len == 0] = 1 << 20  # ids past the tokenizer: never chosen
        self.closers, self.close_classes = _close_classes(token_bytes, special)
        self.special = special
        self.token_text = [b.decode("utf-8", errors="ignore") for b in token_bytes]
        self._cache: OrderedDict[Grammar, str] = OrderedDict()
        self._probed: set[Grammar] = set()  # grammars _probe passed
        self._lock = threading.Lock()

    def compile(self, grammar: Grammar) -> str:
        """llguidance's grammar text for `grammar`, cached; ValueError if it is invalid."""
        with self._lock:
            if grammar in self._cache:
                self._cache.move_to_end(grammar)
                return self._cache[grammar]
        text = self._translate(grammar)
        ok, messages = self._llg.LLMatcher.validate_grammar_with_warnings(text, self.tokenizer)
        if ok:  # is_error
            raise ValueError(f"invalid {grammar.kind} grammar: {messages[0] if messages else ''}")
        with self._lock:
            self._cache[grammar] = text
            while len(self._cache) > 256:
                self._cache.popitem(last=False)
        return text

    def _translate(self, grammar: Grammar) -> str:
        M = self._llg.LLMatcher
        if grammar.kind == "json_object":
            return M.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if grammar.kind == "json_schema":
            try:
                schema = json.loads(grammar.source)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from e
            return M.grammar_from_json_schema(prepare_schema(schema), defaults=JSON_OPTIONS)
        if grammar.kind == "regex":
            return M.grammar_from_regex(grammar.source)
        if grammar.kind == "lark":
            return M.grammar_from_lark(grammar.source)
        raise ValueError(f"unknown grammar kind {grammar.kind!r}")

    def matcher(self, grammar: Grammar) -> GrammarMatcher:
        m = self._llg.LLMatcher(self.tokenizer, self.compile(grammar), log_level=0)
        if m.is_error():
            raise ValueError(f"invalid {grammar.kind} grammar: {m.get_error()}")
        with self._lock:
            probed = grammar in self._probed
        if not probed:
            self._probe(grammar, m)
            with self._lock:
                if len(self._probed) >= 256:
                    self._probed.clear()
                self._probed.add(grammar)
        return GrammarMatcher(self, m)

    def _probe(self, grammar: Grammar, m: Any) -> None:
        """A grammar can compile and still have no finite sentence (a JSON schema whose
        required property is a recursive $ref: `{"a":{"a":...`): its first tokens parse, then
        the parser hits a limit mid-generation. So each new grammar is walked once along a
        greedy close (copies of the matcher, no lookahead); a parser error on the way is a
        ValueError before anything is queued. Running out of steps is not: a legal sentence
        may just be long."""
        sim = GrammarMatcher(self, m.deep_copy())
        row = self.allocate_bitmask(1)[0]
        for _ in range(CLOSE_LOOKAHEAD):
            if sim.m.is_stopped() and not sim.m.is_error():
                return
            sim._fill(row)
            if sim.m.is_error():
                break
            token = sim._closing_token(row, lookahead=False)
            if token in self.eos_ids or not sim.m.consume_token(token):
                break
            sim._advance_cursor(token)
        if sim.m.is_error():
            raise ValueError(f"the {grammar.kind} grammar has no output that ends: "
                             f"{sim.m.get_error().splitlines()[0]}")

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)


def prepare_schema(schema: Any) -> Any:
    """A JSON Schema as llguidance takes it: `$id`s dropped (they only name the schema here;
    references resolve as JSON pointers within it, and llguidance rejects non-URI ids)."""
    if isinstance(schema, dict):
        return {k: prepare_schema(v) for k, v in schema.items() if k != "$id"}
    if isinstance(schema, list):
        return [prepare_schema(v) for v in schema]
    return schema


def allowed_ids(row: torch.Tensor, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return bits.astype(bool)


def is_allowed(row: torch.Tensor, token: int) -> bool:
    return bool(row.numpy().view(np.uint32)[token >> 5] >> np.uint32(token & 31) & 1)


def set_only(row: torch.Tensor, token: int) -> None:
    row.zero_()
    words = row.numpy().view(np.uint32)
    words[token >> 5] = np.uint32(1 << (token & 31))


class GrammarMatcher:
    """The grammar state of one request: masks for the next token, tokens consumed."""

    def __init__(self, backend: GrammarBackend, matcher: Any,
                 cursor: JsonCursor | None = None) -> None:
        self.backend, self.m = backend, matcher
        self.cursor = cursor or JsonCursor()
        self.closing = False
        self._close_estimate = 0
        self._next_check = 1 << 62  # remaining budget at which to re-estimate; first fill: now

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more."""
        return self.m.is_stopped()

    def fill(self, row: torch.Tensor, remaining: int) -> None:
        """Writes the allowed-token bitmask into `row` [V/32] int32; `remaining`: tokens left
        in the request's budget, this one included. A matcher in error (a parser limit) ends
        the request: only end-of-sequence is allowed."""
        try:
            self._estimate(remaining)
            self._fill(row)
            if self.closing:
                set_only(row, self._closing_token(row))
        except ValueError:
            logger.exception("grammar failed; ending the request")
            set_only(row, int(self.backend.eos_ids[0]))

    def _estimate(self, remaining: int) -> None:
        if not self.closing and remaining <= self._next_check:
            self._close_estimate = self._close_cost()
            self.closing = remaining <= self._close_estimate + CLOSE_MARGIN
            # the path to close may grow faster than the budget shrinks (each nesting level
            # adds its closing tokens): re-estimate after a fraction of the slack is used
            slack = remaining - self._close_estimate - CLOSE_MARGIN
            self._next_check = remaining - max(1, slack // CLOSE_RECHECK)

    def _fill(self, row: torch.Tensor) -> None:
        self.m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def _closing_token(self, row: torch.Tensor, lookahead: bool = True) -> int:
        b = self.backend
        allowed = allowed_ids(row, b.vocab_size)
        if self.m.is_accepting():
            eos = b.eos_ids[allowed[b.eos_ids]]
            if len(eos):
                return int(eos[0])
        forced = self.m.compute_ff_tokens()  # a literal the grammar spells out: no choice
        if forced:
            return forced[0]
        suffix = self.cursor.closing_suffix()
        for t in b.closers[allowed[b.closers]]:  # longest first
            t = int(t)
            if t in b.special or (suffix and suffix.startswith(b.token_text[t])):
                return t
        for ids in b.close_classes:
            ok = ids[allowed[ids]]
            if len(ok):
                return int(ok[0])
        lengths = np.where(allowed, b.token_len, 1 << 30)
        k = min(FALLBACK_CANDIDATES, int(allowed.sum()))
        if not lookahead or k <= 1:
            return int(lengths.argmin())
        # several ways on (e.g. which key of an object): the one that closes soonest, so a
        # recursive property is not chosen over a plain one
        shortest = np.argpartition(lengths, k - 1)[:k]
        shortest = shortest[np.argsort(lengths[shortest], kind="stable")]
        costs = []
        for t in shortest:
            sim = GrammarMatcher(b, self.m.deep_copy(), self.cursor.copy())
            sim.accept(int(t))
            costs.append(sim._close_cost(lookahead=False, limit=FALLBACK_LOOKAHEAD))
        return int(shortest[int(np.argmin(costs))])

    def _close_cost(self, lookahead: bool = True, limit: int = CLOSE_LOOKAHEAD) -> int:
        """Tokens a greedy close takes from here (`limit` if more)."""
        sim = GrammarMatcher(self.backend, self.m.deep_copy(), self.cursor.copy())
        row = self.backend.allocate_bitmask(1)[0]
        for n in range(limit):
            if sim.m.is_stopped():
                return n
            sim._fill(row)
            token = sim._closing_token(row, lookahead)
            if token in self.backend.eos_ids:
                return n + 1
            if not sim.m.consume_token(token):
                break
            sim._advance_cursor(token)
        return limit

    def check(self, token: int, remaining: int) -> int:
        """The sampled `token`, or the closing token instead when taking it would leave too
        little budget to close (one token can open a structure whose close is long, e.g. a
        new tool call); `remaining` counts this token. Call before `accept`."""
        if self.closing or remaining > 2 * self._close_estimate + CLOSE_MARGIN + CLOSE_GUARD:
            return token
        b = self.backend
        if self.cursor.in_string and token not in b.special and token < len(b.token_text) \
                and '"' not in b.token_text[token] and "\\" not in b.token_text[token]:
            return token  # more of a string: the way out is the same `"` and suffix
        sim = GrammarMatcher(self.backend, self.m.deep_copy(), self.cursor.copy())
        try:
            sim.accept(token)
        except ValueError:
            return token  # `accept` reports it for this request alone
        if sim.is_terminated or \
                sim._close_cost(limit=remaining) + CLOSE_MARGIN <= remaining - 1:
            return token
        self.closing = True
        row = self.backend.allocate_bitmask(1)[0]
        self._fill(row)
        return self._closing_token(row)

    def near_budget(self, remaining: int, num_drafts: int) -> bool:
        """Whether accepting `num_drafts` drafts (and the bonus token) could eat into the
        closing path's reserve, which only `fill` guards (closing forces one token a step).
        Verify steps skip `fill`, so the estimate is refreshed here."""
        self._estimate(remaining)
        return self.closing or \
            remaining - num_drafts - 1 <= 2 * self._close_estimate + CLOSE_MARGIN + CLOSE_GUARD

    def accept(self, token: int) -> None:
        if not self.m.consume_token(token):
            raise ValueError(f"token {token} violates the grammar: {self.m.get_error()}")
        self._advance_cursor(token)

    def _advance_cursor(self, token: int) -> None:
        if token in self.backend.special:
            self.cursor.reset()
        elif token < len(self.backend.token_text):
            self.cursor.feed(self.backend.token_text[token])

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the grammar accepts in a row from here."""
        return self.m.validate_tokens(tokens)

    def fill_drafts(self, rows: torch.Tensor, drafts: list[int]) -> None:
        """Masks for a verify step: rows[i] for the position after drafts[:i]; the state is
        left as it was."""
        for i, t in enumerate(drafts):
            self._fill(rows[i])
            if not self.m.consume_token(t):
                raise ValueError(f"draft token {t} violates the grammar")
        self._fill(rows[len(drafts)])
        if drafts:
            self.m.rollback(len(drafts))


def forced_token(req: Request) -> int | None:
    """The next token of `reasoning_end` when the request's reasoning budget is spent (and the
    output does not already close it); continues a partly written closing sequence."""
    p = req.params
    if req.reasoning_done or p.reasoning_budget is None or \
            len(req.output_ids) < p.reasoning_budget:
        return None
    end, out = p.reasoning_end, req.output_ids
    for j in range(min(len(end) - 1, len(out)), 0, -1):
        if tuple(out[-j:]) == end[:j]:
            return end[j]
    return end[0]


def note_reasoning(req: Request) -> None:
    """Marks the reasoning closed once the output ends with `reasoning_end`, or once the model
    itself (within its budget) writes the token that starts it, however it spells the rest."""
    p, out = req.params, req.output_ids
    end = p.reasoning_end
    if req.reasoning_done or not end:
        return
    by_model = out[-1] == end[0] and p.reasoning_budget is not None and \
        len(out) <= p.reasoning_budget
    if by_model or tuple(out[-len(end):]) == end:
        req.reasoning_done = True


def needs_mask(req: Request) -> bool:
    return req.matcher is not None or forced_token(req) is not None


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [B, V] -= inf where the bit of bitmask [B, ceil(V/32)] is 0, in place."""
    V = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :V].to(device=logits.device, dtype=torch.bool)
    logits.masked_fill_(~allowed, float("-inf"))


def check_sampled(reqs: list[Request], tokens: list[int]) -> list[int]:
    """Indices whose sampled token `GrammarMatcher.check` replaced (tokens updated in place)."""
    changed = []
    for i, req in enumerate(reqs):
        if req.matcher is not None and forced_token(req) is None:
            t = req.matcher.check(tokens[i], req.params.max_tokens - len(req.output_ids))
            if t != tokens[i]:
                tokens[i] = t
                changed.append(i)
    return changed


def constrain(logits: torch.Tensor, reqs: list[Request], rows: list[int]) -> None:
    """Masks logits rows[i] for reqs[i] by its grammar and reasoning budget, in place."""
    bitmask = torch.full((len(reqs), (logits.shape[1] + 31) // 32), -1, dtype=torch.int32)
    for i, req in enumerate(reqs):
        if req.matcher is not None:
            req.matcher.fill(bitmask[i], req.params.max_tokens - len(req.output_ids))
        forced = forced_token(req)
        # a grammar may not allow it yet (the text ends inside a UTF-8 character): a step later
        if forced is not None and (req.matcher is None or is_allowed(bitmask[i], forced)):
            set_only(bitmask[i], forced)
    idx = torch.tensor(rows, device=logits.device)
    sub = logits.index_select(0, idx)
    apply_bitmask(sub, bitmask)
    logits.index_copy_(0, idx, sub)
