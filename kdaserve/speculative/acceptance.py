"""Which drafts a request may verify (`trim_drafts`: grammar, budgets, raw-row requests), and
lossless acceptance of sampled drafts (`reject_sample`)."""

from __future__ import annotations

import torch

from kdaserve.request import Request


def trim_drafts(running: list[Request]) -> None:
    """A constrained request verifies only the drafts its grammar allows, and none while
    its budget is near the forced closing path or its reasoning budget is near its end
    (forced tokens are placed one a step)."""
    for req in running:
        if not req.draft_ids:
            continue
        p, k = req.params, len(req.draft_ids)
        records = req.options.return_routed_experts or req.options.return_hidden_states
        if p.logit_bias or len(req.output_ids) < p.min_tokens or records:
            req.draft_ids = []  # verification samples raw rows: bias and bans need plain
            continue
        if p.reasoning_budget is not None and not req.reasoning_done \
                and len(req.output_ids) + k + 1 >= p.reasoning_budget:
            req.draft_ids = []
            continue
        m = req.matcher
        if m is None:
            continue
        if m.near_budget(p.max_tokens - len(req.output_ids), k):
            req.draft_ids = []
        else:
            del req.draft_ids[m.valid_prefix(req.draft_ids):]


def reject_sample(probs: torch.Tensor, drafts: list[int],
                  generator: torch.Generator | None) -> tuple[int, int]:
    """Lossless speculative sampling for point-mass drafts (every drafter proposes one
    token, q = 1 on it): accept draft i with probability p_i(d_i); on the first rejection
    sample from the residual max(p_i - q_i, 0), i.e. p_i without d_i, renormalised; after k
    acceptances sample the bonus from p_k. Emitted tokens are then distributed exactly as
    sampling from p step by step. probs: [1 + k, V]. Returns (accepted, next token)."""
    for i, d in enumerate(drafts):
        u = torch.rand(1, generator=generator).item()
        residual = probs[i].clone()
        residual[d] = 0.0
        # (an empty residual means p is a point mass on d: accepting is the only choice)
        if u < probs[i, d].item() or residual.sum() <= 0:
            continue
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return len(drafts), int(torch.multinomial(probs[len(drafts)], 1, generator=generator))
