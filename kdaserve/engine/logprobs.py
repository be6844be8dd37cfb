"""Log-probability entries: the model's raw distribution at one position, reported as a dict
{token id: logprob} holding the scored token, the top-n tokens and any ids the request always
wants (SGLang's token_ids_logprob). The n largest entries of such a dict are the top n.

Prompt positions are scored here, from hidden states the model runner hands back, in slices:
a 2k-token chunk's logits over Kimi's 163k vocabulary would take 1.3 GB at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from kdaserve.kernels.host_memory import to_device
from kdaserve.request import Request

SLICE_ROWS = 256


class Picked(NamedTuple):
    """What a batch's entries are built from, gathered on the logits' device."""
    chosen: torch.Tensor  # [R] each row's scored token's logprob
    top_values: torch.Tensor  # [R, k] the k best, k the largest top asked (may be 0)
    top_ids: torch.Tensor
    extra: torch.Tensor  # the ids each row always wants, row after row, flat

    def to_host(self) -> Picked:
        return Picked(*(t.cpu() for t in self))


def pick(logprobs: torch.Tensor, tokens: torch.Tensor, top: list[int],
         extra: list[list[int]]) -> Picked:
    """logprobs [R, V], tokens [R] -> the values entries are built from; device ops only, so
    an overlapped step (engine/overlap.py) copies them to the host behind its own step."""
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    values, ids = logprobs.topk(max(top, default=0), dim=-1)
    rows = [r for r, want in enumerate(extra) for _ in want]
    cols = [t for want in extra for t in want]
    dev = logprobs.device
    picked = logprobs[to_device(torch.tensor(rows, dtype=torch.int64), dev),
                      to_device(torch.tensor(cols, dtype=torch.int64), dev)] if rows \
        else logprobs.new_empty(0)
    return Picked(chosen, values, ids, picked)


def build_entries(picked: Picked, tokens: list[int], top: list[int],
                  extra: list[list[int]]) -> list[dict[int, float]]:
    """One entry per row from host values: row i with its top[i] best tokens, the ids
    extra[i], and its scored token."""
    out: list[dict[int, float]] = [{} for _ in tokens]
    if picked.top_ids.shape[1]:
        for d, n, i, v in zip(out, top, picked.top_ids.tolist(), picked.top_values.tolist(),
                              strict=True):
            d.update(zip(i[:n], v[:n], strict=True))
    flat = iter(picked.extra.tolist())
    for d, want in zip(out, extra, strict=True):
        d.update((t, next(flat)) for t in want)
    for d, t, v in zip(out, tokens, picked.chosen.tolist(), strict=True):
        d[t] = v
    return out


def entries(logprobs: torch.Tensor, tokens: torch.Tensor, top: list[int],
            extra: list[list[int]]) -> list[dict[int, float]]:
    """logprobs [R, V], tokens [R] -> one entry per row, row i with its top[i] best tokens
    and the ids extra[i]."""
    return build_entries(pick(logprobs, tokens, top, extra).to_host(), tokens.tolist(), top,
                         extra)


def record_prompt_logprobs(req: Request, hidden: torch.Tensor,
                           compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Scores the prompt tokens that `hidden` (the final hidden states of the rows from
    req.prompt_logits_row on) predicts, appending to req.prompt_logprobs."""
    assert req.prompt_logprobs is not None
    row = req.prompt_logits_row
    assert row is not None
    p = req.params
    targets = torch.tensor(req.prompt_ids[row + 1:row + 1 + hidden.shape[0]],
                           device=hidden.device)
    for a in range(0, hidden.shape[0], SLICE_ROWS):
        logprobs = compute_logits(hidden[a:a + SLICE_ROWS]).log_softmax(-1)
        rows = logprobs.shape[0]
        req.prompt_logprobs.extend(entries(logprobs, targets[a:a + SLICE_ROWS],
                                           [p.prompt_logprobs or 0] * rows,
                                           [p.token_ids_logprob] * rows))
