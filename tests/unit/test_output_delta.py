"""Outputs sent as deltas across the engine process's boundary (client/output_delta.py): the
client rebuilds exactly the engine's cumulative outputs, through growing and held-back text,
logprobs, several completions and interleaved requests, and a late update costs bytes for
what is new only."""

from __future__ import annotations

import dataclasses
import pickle
import random

from kdaserve.client.output_delta import DeltaDecoder, DeltaEncoder, _common_prefix, with_parts
from kdaserve.request import CompletionOutput, RequestOutput


def updates(rid: str, steps: int, n: int, seed: int, logprobs: bool) -> list[RequestOutput]:
    """A request's cumulative outputs, step by step: each completion gains a token, its text
    usually grows, sometimes gives back a held-back tail, once is rewritten inside."""
    rng = random.Random(seed)
    prompt = [rng.randrange(1000) for _ in range(50)]
    toks: list[list[int]] = [[] for _ in range(n)]
    texts = [""] * n
    lps: list[list[dict[int, float]]] = [[] for _ in range(n)]
    out = []
    for s in range(steps):
        children = []
        for i in range(n):
            toks[i].append(rng.randrange(1000))
            lps[i].append({toks[i][-1]: -rng.random()})
            r = rng.random()
            if r < 0.1 and texts[i]:
                texts[i] = texts[i][:-1]  # a stop-string hold-back
            elif r < 0.12 and len(texts[i]) > 3:
                texts[i] = texts[i][:2] + "\ufffd" + texts[i][3:]  # rewritten inside
            else:
                texts[i] += rng.choice(["a", "bc", " def", "\u00e9"])
            children.append(CompletionOutput(
                i, list(toks[i]), texts[i], "length" if s == steps - 1 else None,
                logprobs=list(lps[i]) if logprobs else None,
                cumulative_logprob=-float(s) if logprobs else None))
        out.append(RequestOutput(rid, prompt, children, finished=s == steps - 1))
    return out


def test_decoded_outputs_equal_the_engines() -> None:
    enc, dec = DeltaEncoder(), DeltaDecoder()
    streams = [updates("a", 40, 1, 0, False), updates("b", 25, 3, 1, True),
               updates("c", 60, 2, 2, True)]
    order = [(j, k) for j, s in enumerate(streams) for k in range(len(s))]
    random.Random(3).shuffle(order)
    order.sort(key=lambda jk: jk[1])  # interleaved, each request's updates in order
    for j, k in order:
        want = streams[j][k]
        got = dec.decode(pickle.loads(pickle.dumps(enc.encode(want))))
        assert got == want, (j, k)
    assert not enc.sent and not dec.last  # finished requests forgotten on both sides


def test_a_late_update_sends_only_what_is_new() -> None:
    ups = updates("r", 400, 1, 4, True)
    enc = DeltaEncoder()
    for u in ups[:-2]:
        enc.encode(u)
    late = pickle.dumps(enc.encode(ups[-2]))
    assert len(late) * 10 < len(pickle.dumps(ups[-2]))  # ~500 bytes against ~8 KB


def test_an_error_forgets_the_request() -> None:
    enc, dec = DeltaEncoder(), DeltaDecoder()
    u = updates("r", 3, 1, 5, False)
    dec.decode(enc.encode(u[0]))
    enc.forget("r")
    dec.forget("r")
    assert not enc.sent and not dec.last
    again = enc.encode(u[1])  # the same id again (a new request): whole, and rebuilt whole
    assert again.first and dec.decode(again) == u[1]


def test_with_parts_keeps_every_other_field() -> None:
    """Every CompletionOutput field gets a distinct value: a field with_parts forgot (one
    added later) would come back as its default."""
    values = {f.name: object() for f in dataclasses.fields(CompletionOutput)}
    o = CompletionOutput(**values)
    got = with_parts(o, [1], "t", [])
    for name, v in values.items():
        want = {"token_ids": [1], "text": "t", "logprobs": []}.get(name, v)
        assert getattr(got, name) == want or getattr(got, name) is want, name


def test_common_prefix() -> None:
    for a, b in (("", "x"), ("abc", "abd"), ("abc", "abc"), ("abcdef", "ab"), ("x", "y")):
        want = next((i for i, (p, q) in enumerate(zip(a, b, strict=False)) if p != q),
                    min(len(a), len(b)))
        assert _common_prefix(a, b) == want
