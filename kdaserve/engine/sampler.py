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
from kdaserve.sampling_filters import apply_filters, column

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
    freq = column([r.params.frequency_penalty for r in reqs], dev)
    pres = column([r.params.presence_penalty for r in reqs], dev)
    logits = logits - freq * counts - pres * (counts > 0)
    rep = column([r.params.repetition_penalty for r in reqs], dev)
    if any(r.params.repetition_penalty != 1.0 for r in reqs):  # (asked on the host: no sync)
        seen = counts > 0
        for i, r in enumerate(reqs):
            if r.params.repetition_penalty != 1.0:
                seen[i, torch.tensor(r.prompt_ids, device=dev)] = True
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
    return logits


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
