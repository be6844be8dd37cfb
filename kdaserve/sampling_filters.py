"""Temperature, top-k, top-p and min-p over a batch's logits [B, V], each row with its
request's parameters: the filters the engine's sampler (engine/sampler.py) and the
speculative verify's rejection sampling (speculative/verify.py) both apply, so below both."""

from __future__ import annotations

import torch

from kdaserve.kernels.host_memory import to_device
from kdaserve.request import Request


def column(values: list[float], device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=torch.float32), device).unsqueeze(1)


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
    temps = column([r.params.temperature or 1.0 for r in reqs], dev)
    logits = logits / temps
    top_k = to_device(torch.tensor([r.params.top_k or V for r in reqs]), dev)
    top_p = column([r.params.top_p for r in reqs], dev)
    min_p = column([r.params.min_p for r in reqs], dev)
    # the parameters are asked on the host: on a GPU a tensor's .any() waits for the step
    if any((r.params.top_k or V) < V or r.params.top_p < 1 for r in reqs):
        logits = _top_k_top_p(logits, top_k, top_p)
    probs = logits.softmax(-1)
    if any(r.params.min_p > 0 for r in reqs):
        probs = probs.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, 0.0)
    return probs
