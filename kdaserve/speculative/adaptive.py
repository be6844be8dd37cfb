"""Who speculates this step: speculation off for a request whose drafts keep missing, and off
for the whole batch once it is large enough that a decode step is compute-bound.

A verify of k drafts costs a forward over 1 + k tokens. While the batch is small the step is
bound by reading the weights, so those extra tokens ride almost free; once the batch is large
every token costs its FLOPs, and drafts that miss only slow the batch down
(`speculative_disable_by_batch_size`, vLLM's knob of the same name; `bench spec --batch-sizes`
measures where that is). For one request, a drafter with nothing to go on (prompt lookup on
text that does not repeat, a draft model on text it does not know) makes every verify a loss:
after `MIN_VERIFIES` verifies whose recent acceptance rate (drafts kept / drafts proposed,
an exponential average) is under `speculative_min_acceptance_rate`, the request decodes
without drafts for a while, then tries again, backing off longer each time it fails.
"""

from __future__ import annotations

from dataclasses import dataclass

from kdaserve.request import Request

MIN_VERIFIES = 4  # verifies seen before a request may be switched off
EMA = 0.3  # weight of the newest verify in the acceptance average
FIRST_BACKOFF, MAX_BACKOFF = 16, 256  # tokens decoded without drafts, doubling per failure


@dataclass
class Track:
    rate: float = 0.0
    verifies: int = 0
    off_until: int = 0  # output length before which the request does not draft
    backoff: int = FIRST_BACKOFF


class AdaptiveSpeculation:
    def __init__(self, min_acceptance_rate: float = 0.0,
                 disable_by_batch_size: int | None = None) -> None:
        self.min_rate, self.max_batch = min_acceptance_rate, disable_by_batch_size
        self.tracks: dict[int, Track] = {}
        self.num_switched_off = 0  # times a request stopped drafting for low acceptance
        self.num_batch_skips = 0  # steps a large batch did not draft

    def batch_allows(self, running: list[Request], count: bool = True) -> bool:
        """count: a step skipped for its size is counted (not when merely asked)."""
        if self.max_batch is not None and \
                sum(not r.is_prefilling for r in running) > self.max_batch:
            self.num_batch_skips += count
            return False
        return True

    def allows(self, req: Request) -> bool:
        t = self.tracks.get(id(req))
        return t is None or len(req.output_ids) >= t.off_until

    def resumes_within(self, req: Request, tokens: int) -> bool:
        """Whether req may draft again within `tokens` tokens."""
        t = self.tracks.get(id(req))
        return t is None or t.off_until - len(req.output_ids) <= tokens

    def record(self, req: Request, drafted: int, accepted: int) -> None:
        if self.min_rate <= 0 or drafted == 0:
            return
        t = self.tracks.setdefault(id(req), Track())
        rate = accepted / drafted
        t.rate = rate if t.verifies == 0 else (1 - EMA) * t.rate + EMA * rate
        t.verifies += 1
        if t.verifies >= MIN_VERIFIES and t.rate < self.min_rate:
            t.off_until = len(req.output_ids) + t.backoff
            t.backoff = min(2 * t.backoff, MAX_BACKOFF)
            t.verifies = 0  # the next try is judged on its own verifies
            self.num_switched_off += 1
        elif t.verifies >= MIN_VERIFIES:
            t.backoff = FIRST_BACKOFF  # drafting pays again: a later miss backs off briefly

    def forget(self, req: Request) -> None:
        self.tracks.pop(id(req), None)
