"""Log-probability entries: the model's raw distribution at one position, reported as a dict
{token id: logprob} holding the scored token, the top-n tokens and any ids the request always
wants (SGLang's token_ids_logprob). The n largest entries of such a dict are the top n.

Prompt positions are scored here, from hidden states the model runner hands back, in slices:
a 2k-token chunk's logits over Kimi's 163k vocabulary would take 1.3 GB at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kdaserve.request import Request

SLICE_ROWS = 256


def entries(logprobs: torch.Tensor, tokens: torch.Tensor, top: list[int],
            extra: list[list[int]]) -> list[dict[int, float]]:
    """logprobs [R, V], tokens [R] -> one entry per row, row i with its top[i] best tokens
    and the ids extra[i]."""
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    out: list[dict[int, float]] = [{} for _ in chosen]
    k = max(top, default=0)
    if k:
        values, ids = logprobs.topk(k, dim=-1)
        for d, n, i, v in zip(out, top, ids.tolist(), values.tolist(), strict=True):
            d.update(zip(i[:n], v[:n], strict=True))
    for r, (d, want) in enumerate(zip(out, extra, strict=True)):
        if want:
            d.update(zip(want, logprobs[r, want].tolist(), strict=True))
    for d, t, v in zip(out, tokens.tolist(), chosen, strict=True):
        d[t] = v
    return out


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
