"""Vectorised sampling over a batch with per-request parameters.

Penalties, temperature, top-k, top-p and min-p are applied to the whole [B, V] logits at once.
Random draws use the exponential race (argmax p / E, E ~ Exp(1)), which equals sampling from p;
only requests with their own seed draw their noise row from their own generator, so seeded
requests are reproducible whatever else is in the batch.
Returned logprobs are those of the model's raw distribution (before penalties/temperature), as
vLLM and SGLang report them.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from kdaserve.engine.logprobs import Picked, build_entries, pick
from kdaserve.kernels import argmax_rows
from kdaserve.kernels.host_memory import to_device
from kdaserve.request import Request

logger = logging.getLogger("kdaserve")


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[float] | None  # of the sampled tokens, when any request asked
    top_logprobs: list[dict[int, float]] | None


class Drawn(NamedTuple):
    tokens: torch.Tensor  # [B] int64, on the logits' device
    logprobs: Picked | None  # of the raw distribution, when any request asked for them


def _wanted(reqs: list[Request]) -> list[list[int]]:
    return [r.params.token_ids_logprob if r.params.logprobs is not None else [] for r in reqs]


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=torch.float32), device).unsqueeze(1)


def apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    B, V = logits.shape
    dev = logits.device
    out_lens = [len(r.output_ids) for r in reqs]
    width = max(max(out_lens), 1)
    out = torch.full((B, width), V, dtype=torch.int64)  # V: a padding column, dropped below
    for i, r in enumerate(reqs):
        if r.output_ids:
            out[i, : out_lens[i]] = torch.tensor(r.output_ids)
    counts = torch.zeros(B, V + 1, device=dev).scatter_add_(
        1, out.to(dev), torch.ones(B, width, device=dev))[:, :V]
    freq = _column([r.params.frequency_penalty for r in reqs], dev)
    pres = _column([r.params.presence_penalty for r in reqs], dev)
    logits = logits - freq * counts - pres * (counts > 0)
    rep = _column([r.params.repetition_penalty for r in reqs], dev)
    if any(r.params.repetition_penalty != 1.0 for r in reqs):  # (asked on the host: no sync)
        seen = counts > 0
        for i, r in enumerate(reqs):
            if r.params.repetition_penalty != 1.0:
                seen[i, torch.tensor(r.prompt_ids, device=dev)] = True
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
    return logits


TOP_WINDOW = 2048  # top-p over the best W tokens when they hold the mass (no full-vocab sort)


def _sorted_filter(logits: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor) -> torch.Tensor:
    V = logits.shape[1]
    sorted_logits, order = logits.sort(-1, descending=True)
    ranks = torch.arange(V, device=logits.device).unsqueeze(0)
    drop = ranks >= top_k.unsqueeze(1)
    sorted_p = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    # drop a token once the mass before it reaches top_p (the top token always stays);
    # top_p == 1 rows are exempt: float32 cumsum can round to 1 before the tail
    drop |= ((sorted_p.cumsum(-1) - sorted_p) >= top_p) & (top_p < 1)
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p masks. Sorting Kimi's 163k-token vocabulary costs ~20 ms a step on a
    CPU, so the best TOP_WINDOW tokens are taken first (topk): when top-k falls inside them
    and the top-p mass is reached inside them, the result equals the full sort's, since
    every later token is dropped either way. Otherwise (a flat distribution) the full sort."""
    B, V = logits.shape
    W = min(V, TOP_WINDOW)
    filtered = (top_k < V) | (top_p.squeeze(1) < 1)
    # a GPU sorts the vocabulary fast, and the window's fallbacks below read values back,
    # which would wait for the step in flight (engine/overlap.py)
    if W == V or logits.device.type == "cuda":
        return _sorted_filter(logits, top_k, top_p)
    vals, order = logits.topk(W, dim=-1)
    ranks = torch.arange(W, device=logits.device).unsqueeze(0)
    k_in = top_k <= W
    drop = ranks >= top_k.unsqueeze(1)
    masked = vals.masked_fill(drop, float("-inf"))
    norm = torch.where(k_in.unsqueeze(1), masked.logsumexp(-1, keepdim=True),
                       logits.logsumexp(-1, keepdim=True))
    sorted_p = (masked - norm).exp()
    # top-k past the window: its mass is not the window's normaliser, so the full sort
    reached = ((sorted_p.sum(-1, keepdim=True) >= top_p) & (top_p < 1)).squeeze(1)
    inside = k_in | (reached & (top_k >= V))
    drop |= ((sorted_p.cumsum(-1) - sorted_p) >= top_p) & (top_p < 1)
    out = torch.full_like(logits, float("-inf")).scatter(
        1, order, vals.masked_fill(drop, float("-inf")))
    out = torch.where(filtered.unsqueeze(1), out, logits)
    # decided row by row, so a row's result never depends on its neighbours in the batch
    rest = filtered & ~inside
    flat = rest & (top_k >= V)  # top-p alone over a flat distribution: by buckets
    for r in flat.nonzero().squeeze(1).tolist():
        out[r] = _bucketed_top_p(logits[r], float(top_p[r]))
    rest = (rest & ~flat).nonzero().squeeze(1)
    if len(rest):
        out[rest] = _sorted_filter(logits[rest], top_k[rest], top_p[rest])
    return out


TOP_P_BUCKETS = 1024  # over log-probabilities within TOP_P_SPAN of the best
TOP_P_SPAN = 40.0


def _bucketed_top_p(row: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p of one row [V] without sorting it: tokens are bucketed by log-probability and the
    bucket masses summed from the top; buckets before the one where the mass reaches top_p are
    kept whole, later ones dropped, and only the tokens of that one bucket are sorted. Masses
    are summed in float64 (the full sort's float32 cumsum over 163k terms drifts by ~1e-5)."""
    logp = row.log_softmax(-1)
    rel = (logp.max() - logp).nan_to_num(posinf=TOP_P_SPAN)
    bucket = (rel * (TOP_P_BUCKETS / TOP_P_SPAN)).long().clamp_(max=TOP_P_BUCKETS - 1)
    p = logp.double().exp()
    mass = torch.zeros(TOP_P_BUCKETS, dtype=torch.float64).scatter_add_(0, bucket, p)
    cum = mass.cumsum(0)
    b = int((cum < top_p).sum().clamp(max=TOP_P_BUCKETS - 1))  # first bucket reaching top_p
    before = float(cum[b] - mass[b])
    keep = bucket < b
    idx = (bucket == b).nonzero().squeeze(1)
    vals, order = p[idx].sort(descending=True)
    keep[idx[order]] = (vals.cumsum(0) - vals + before) < top_p
    return row.masked_fill(~keep, float("-inf"))


def apply_filters(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Temperature, then top-k / top-p / min-p masks; returns the probabilities [B, V]."""
    B, V = logits.shape
    dev = logits.device
    temps = _column([r.params.temperature or 1.0 for r in reqs], dev)
    logits = logits / temps
    top_k = to_device(torch.tensor([r.params.top_k or V for r in reqs]), dev)
    top_p = _column([r.params.top_p for r in reqs], dev)
    min_p = _column([r.params.min_p for r in reqs], dev)
    # the parameters are asked on the host: on a GPU a tensor's .any() waits for the step
    if any((r.params.top_k or V) < V or r.params.top_p < 1 for r in reqs):
        logits = _top_k_top_p(logits, top_k, top_p)
    probs = logits.softmax(-1)
    if any(r.params.min_p > 0 for r in reqs):
        probs = probs.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, 0.0)
    return probs


def apply_bias(logits: torch.Tensor, reqs: list[Request],
               stop_ids: frozenset[int]) -> torch.Tensor:
    """logit_bias, and min_tokens: stop tokens banned while a request is short of it (a row
    the ban would empty, e.g. a grammar that allows only EOS, is left as it was)."""
    rows, cols, vals = [], [], []
    banned = []
    for i, r in enumerate(reqs):
        p = r.params
        for t, b in p.logit_bias.items():
            rows.append(i)
            cols.append(t)
            vals.append(b)
        if len(r.output_ids) < p.min_tokens:
            banned.append((i, sorted(stop_ids | set(p.stop_token_ids))))
    dev = logits.device
    if rows:
        logits = logits.index_put(
            (to_device(torch.tensor(rows), dev), to_device(torch.tensor(cols), dev)),
            to_device(torch.tensor(vals, dtype=logits.dtype), dev), accumulate=True)
    if banned:
        before = logits
        logits = logits.clone()
        for i, ids in banned:
            logits[i, ids] = float("-inf")
        empty = torch.isinf(logits).all(-1, keepdim=True)
        logits = torch.where(empty, before, logits)
    return logits


class Sampler:
    def __init__(self, stop_ids: frozenset[int] = frozenset()) -> None:
        self.stop_ids = stop_ids  # the model's EOS tokens, banned before min_tokens

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
        """logits: fp32 [B, V], row i for reqs[i]."""
        drawn = self.draw(logits, reqs)
        return self.read(drawn, reqs, drawn.tokens.tolist())

    def draw(self, logits: torch.Tensor, reqs: list[Request]) -> Drawn:
        """The tokens, on the logits' device: nothing here waits for the device, so an
        overlapped step (engine/overlap.py) reads them a step later."""
        # one pass over the requests' parameters (four were ~1 us a request a step)
        want_logprobs = biased = penalised = False
        all_greedy = True
        for r in reqs:
            p = r.params
            want_logprobs = want_logprobs or p.logprobs is not None
            biased = biased or bool(p.logit_bias or p.min_tokens)
            penalised = penalised or bool(p.repetition_penalty != 1.0 or p.presence_penalty
                                          or p.frequency_penalty)
            all_greedy = all_greedy and p.is_greedy
        raw_logprobs = logits.log_softmax(-1) if want_logprobs else None
        if biased:
            logits = apply_bias(logits, reqs, self.stop_ids)
        if penalised:
            logits = apply_penalties(logits, reqs)
        tokens = argmax_rows(logits)
        # on a GPU the token ids' copy is the step's one wait for the device: whether to
        # draw is decided from the host's parameters, not from a device tensor
        if not all_greedy:
            dev = logits.device
            greedy = to_device(torch.tensor([r.params.is_greedy for r in reqs]), dev)
            probs = apply_filters(logits, reqs)
            noise = torch.empty_like(probs).exponential_()
            seeded = [i for i, r in enumerate(reqs)
                      if r.generator is not None and not r.params.is_greedy]
            if seeded:  # their own generators' rows, on the host, sent in one copy
                rows = torch.stack([torch.empty(probs.shape[1]).exponential_(
                    generator=reqs[i].generator) for i in seeded])
                noise[to_device(torch.tensor(seeded), dev)] = to_device(rows, dev)
            sampled = (probs / noise).argmax(-1)
            tokens = torch.where(greedy, tokens, sampled)
        if raw_logprobs is None:
            return Drawn(tokens, None)
        return Drawn(tokens, pick(raw_logprobs, tokens, [r.params.logprobs or 0 for r in reqs],
                                  _wanted(reqs)))

    @staticmethod
    def read(drawn: Drawn, reqs: list[Request], token_list: list[int]) -> SamplerOutput:
        """The host's output of a draw whose tokens it has read (token_list); the logprobs'
        values are read here unless they are host tensors already."""
        if drawn.logprobs is None:
            return SamplerOutput(token_list, None, None)
        top = build_entries(drawn.logprobs.to_host(), token_list,
                            [r.params.logprobs or 0 for r in reqs], _wanted(reqs))
        return SamplerOutput(token_list, [d[t] for d, t in zip(top, token_list, strict=True)],
                             top)


def sample_isolated(sampler: Sampler, logits: torch.Tensor, reqs: list[Request],
                    ) -> tuple[SamplerOutput, list[tuple[Request, str]]]:
    """The batched sampler; if it fails, each request is sampled alone, and those that fail
    alone are returned as (request, why) with a placeholder token the caller must not use:
    one bad request never fails the batch."""
    # seeded requests' generators as they were: a batch that fails after drawing their noise
    # must not move them on, or their tokens would differ from an undisturbed run
    seeded = [(r.generator, r.generator.get_state()) for r in reqs if r.generator is not None]
    try:
        return sampler(logits, reqs), []
    except Exception:  # noqa: BLE001 - isolated below, row by row
        logger.exception("batched sampling failed; sampling each request alone")
    for generator, state in seeded:
        generator.set_state(state)
    failed: list[tuple[Request, str]] = []
    tokens: list[int] = []
    lps: list[float] = []
    tops: list[dict[int, float]] = []
    for i, req in enumerate(reqs):
        try:
            one = sampler(logits[i:i + 1], [req])
        except Exception as e:  # noqa: BLE001 - this request's own failure
            logger.exception("request %s: sampling failed", req.rid)
            failed.append((req, f"sampling failed: {type(e).__name__}: {e}"))
            one = SamplerOutput([0], None, None)
        tokens += one.token_ids
        lps += one.logprobs or [0.0]
        tops += one.top_logprobs or [{}]
    want = any(r.params.logprobs is not None for r in reqs)
    return SamplerOutput(tokens, lps if want else None, tops if want else None), failed
