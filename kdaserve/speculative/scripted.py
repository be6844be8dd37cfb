"""A drafter with a known acceptance, for the speculation tests and the GPU check
(scripts/gpu_smoke.py): it wraps a real drafter (or none) and forces how many drafts get
accepted, so a verify path can be checked against plain decoding at every acceptance count."""

from __future__ import annotations

import torch

from kdaserve.request import Request
from kdaserve.speculative.drafter import Drafter


class ScriptedDrafter(Drafter):
    """Wraps a drafter (or none). After the inner drafter proposes, each request's drafts are
    optionally replaced by the target's own greedy tokens (`futures`: prompt -> greedy
    continuation; as many as the inner drafter's confidences put at `min_survival` or more,
    or k without one) and then corrupted at the `corrupt` positions, so the number accepted
    is known: min(first corrupt position, number drafted). Every draft is reported certain
    (survival 1), so the engine's schedule verifies them all. Every verification is logged as
    (drafted, accepted)."""

    def __init__(self, inner: Drafter | None, k: int, vocab: int,
                 futures: dict[tuple[int, ...], list[int]] | None = None,
                 corrupt: set[int] | frozenset[int] = frozenset(),
                 min_survival: float = 0.05) -> None:
        self.inner, self.k, self.vocab = inner, k, vocab
        self.futures, self.corrupt, self.min_survival = futures, corrupt, min_survival
        self.wants_hidden = inner is not None and inner.wants_hidden  # type: ignore[misc]
        self.taps = inner.taps if inner is not None else ()
        self.context_stream = inner.context_stream if inner is not None else None
        self.proposed: dict[int, list[int]] = {}
        self.log: list[tuple[int, int]] = []
        self.drafted: list[list[int]] = []  # every proposal, in order

    def propose(self, reqs: list[Request]) -> None:
        if self.inner is not None:
            self.inner.propose(reqs)
        for req in reqs:
            own = self.inner.survival(req) if self.inner is not None else None
            if own is not None:  # the lengths the inner drafter's confidences support
                req.draft_ids = req.draft_ids[:sum(p >= self.min_survival for p in own)]
            if self.futures is not None:
                n = len(req.draft_ids) if self.inner is not None else self.max_draft_tokens(req)
                req.draft_ids = self._future(req.all_ids)[:n]
            req.draft_ids = [(t + 1) % self.vocab if i in self.corrupt else t
                             for i, t in enumerate(req.draft_ids)]
            self.proposed[id(req)] = list(req.draft_ids)
            self.drafted.append(list(req.draft_ids))

    def survival(self, req: Request) -> list[float] | None:
        return [1.0] * len(self.proposed.get(id(req), []))

    def _future(self, ids: list[int]) -> list[int]:
        assert self.futures is not None
        for prompt, future in self.futures.items():
            if tuple(ids[:len(prompt)]) == prompt:
                return future[len(ids) - len(prompt):]
        return []

    def expected_accepts(self, num_drafted: int) -> int:
        return min([num_drafted, *self.corrupt])

    def on_accept(self, req: Request, num_accepted: int,
                  hidden: torch.Tensor | None = None) -> None:
        self.log.append((len(self.proposed.pop(id(req), [])), num_accepted))
        if self.inner is not None:
            self.inner.on_accept(req, num_accepted, hidden)

    def on_context(self, req: Request, rows: torch.Tensor, start: int) -> None:
        if self.inner is not None:
            self.inner.on_context(req, rows, start)

    def on_admit(self, req: Request) -> None:
        if self.inner is not None:
            self.inner.on_admit(req)

    def on_release(self, req: Request) -> None:
        if self.inner is not None:
            self.inner.on_release(req)

    def on_finish(self, req: Request) -> None:
        self.proposed.pop(id(req), None)
        if self.inner is not None:
            self.inner.on_finish(req)

    def on_preempt(self, req: Request) -> None:
        self.proposed.pop(id(req), None)
        if self.inner is not None:
            self.inner.on_preempt(req)

    def check_integrity(self, idle: bool = False) -> None:
        assert not (idle and self.proposed), "drafts of finished requests still tracked"
        if self.inner is not None:
            self.inner.check_integrity(idle)
