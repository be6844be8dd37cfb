"""Outputs across the engine process's boundary as deltas.

The engine's `RequestOutput`s are cumulative: every update carries the prompt, every token and
the whole text so far. Pickled to the HTTP process at every step, that is O(length) bytes per
request per step: 64 requests at 2,000 generated tokens cost 5 ms to pickle and 8 ms to
unpickle a step, as much host time as a third of the forward on a 2-core CPU. So the engine
process sends each update as the difference from the last one it sent for that request
(`DeltaEncoder`), and the client rebuilds the cumulative output (`DeltaDecoder`): the
consumers see exactly what the engine made. SGLang's scheduler likewise sends its detokenizer
only the new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kdaserve.request import CompletionOutput, RequestOutput

# per completion: tokens, text and logprob entries already sent
Sent = tuple[int, str, int]


@dataclass(slots=True)
class OutputDelta:
    """`out` with each completion's token_ids, text and logprobs cut to what is new (the
    prompt's ids only in a request's first update); a completion's new text replaces its old
    text from `text_keep[i]` on (almost always its end: a stop-string hold-back can shorten
    what was visible)."""

    out: RequestOutput
    text_keep: list[int]
    first: bool


class DeltaEncoder:
    """Engine side: remembers, per request in flight, what it has sent."""

    def __init__(self) -> None:
        self.sent: dict[str, list[Sent]] = {}

    def encode(self, out: RequestOutput) -> OutputDelta:
        prev = self.sent.get(out.rid)
        first = prev is None
        children, keeps, now = [], [], []
        for i, o in enumerate(out.outputs):
            n, text, k = prev[i] if prev is not None and i < len(prev) else (0, "", 0)
            new_text = o.text
            keep = 0
            if new_text is not None:
                keep = len(text) if new_text.startswith(text) else _common_prefix(text, new_text)
                new_text = new_text[keep:]
            children.append(with_parts(o, o.token_ids[n:], new_text,
                                       None if o.logprobs is None else o.logprobs[k:]))
            keeps.append(keep)
            now.append((len(o.token_ids), o.text or "", len(o.logprobs or ())))
        if out.finished:
            self.sent.pop(out.rid, None)
        else:
            self.sent[out.rid] = now
        return OutputDelta(replace(out, prompt_token_ids=out.prompt_token_ids if first else [],
                                   outputs=children), keeps, first)

    def forget(self, rid: str) -> None:
        """The request ended without a finished output (an error)."""
        self.sent.pop(rid, None)


class DeltaDecoder:
    """Client side: rebuilds each request's cumulative output from its deltas."""

    def __init__(self) -> None:
        self.last: dict[str, RequestOutput] = {}

    def decode(self, delta: OutputDelta) -> RequestOutput:
        d = delta.out
        prev = None if delta.first else self.last.get(d.rid)
        outputs: list[CompletionOutput] = []
        for i, o in enumerate(d.outputs):
            p = prev.outputs[i] if prev is not None and i < len(prev.outputs) else None
            text = o.text
            if text is not None and p is not None and p.text is not None:
                text = p.text[:delta.text_keep[i]] + text
            logprobs = o.logprobs
            if logprobs is not None and p is not None and p.logprobs is not None:
                logprobs = p.logprobs + logprobs
            outputs.append(with_parts(o, (p.token_ids if p else []) + o.token_ids, text,
                                      logprobs))
        out = replace(d, prompt_token_ids=prev.prompt_token_ids if prev else d.prompt_token_ids,
                      outputs=outputs)
        if out.finished:
            self.last.pop(d.rid, None)
        else:
            self.last[d.rid] = out
        return out

    def forget(self, rid: str) -> None:
        self.last.pop(rid, None)

    def reset(self) -> None:
        """The engine process is gone: its requests failed, its deltas end."""
        self.last.clear()


def with_parts(o: CompletionOutput, token_ids: list[int], text: str | None,
               logprobs: list[dict[int, float]] | None) -> CompletionOutput:
    """`o` with those three fields replaced; every field named (`dataclasses.replace` is
    generic and took most of a step's encoding time; a test checks no field is missed)."""
    return CompletionOutput(o.index, token_ids, text, o.finish_reason, o.stop_reason, logprobs,
                            o.cumulative_logprob, o.spec_num_drafted, o.spec_num_accepted,
                            o.spec_num_verifies, o.routed_experts, o.hidden_states)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    lo, hi = 0, n  # the longest equal prefix, by halving (each probe a C-speed compare)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
