"""When a context drafter's taps are taken, and how each step's rows reach it.

A context drafter (K3's published ones, `context_drafter.py`) needs the target's taps at every
position, which cost a decode step its one-call native path and the drafter a context write:
measured on k3-bench at batch 1, 71.7 tok/s plain against 53.5 with a drafter that drafted 1%
of steps. So the taps stop once no request will draft soon (the schedule has skipped
TAPS_OFF_AFTER steps in a row after drafting that paid, or an exploration
ended, or every request is switched off for longer than TAPS_WARMUP
tokens) and come back TAPS_WARMUP steps before drafting may (an exploration warms up that
long: speculative/explore.py): the context then restarts there (a gap costs acceptance, never
correctness). Prefill chunks are always tapped.
"""

from __future__ import annotations

import itertools
import time

import torch

from kdaserve.request import Request
from kdaserve.scheduled_batch import ScheduledBatch
from kdaserve.speculative.adaptive import AdaptiveSpeculation
from kdaserve.speculative.drafter import Drafter

TAPS_OFF_AFTER = 8
TAPS_WARMUP = 16
CONTEXT_EMA = 0.2  # weight of the newest step's context writes in their typical time


class ContextTaps:
    """The Speculator's part for a context drafter: whether a step taps, the step's rows per
    request, and handing the committed ones over (timed: they are a cost of drafting)."""

    def __init__(self, adaptive: AdaptiveSpeculation) -> None:
        self.adaptive = adaptive
        # this step's (request, its first row in the forward, its position)
        self.rows: list[tuple[Request, int, int]] = []
        self.seconds = 0.0  # recent context writes' wall time, per tapped step

    def tapping(self, batch: ScheduledBatch, drafting_soon: bool) -> bool:
        """A prefill chunk always; else only while some request may draft within
        TAPS_WARMUP steps (`drafting_soon`: the schedule's word for the batch)."""
        if any(r.is_prefilling for r in batch.reqs):
            return True
        if not (drafting_soon and self.adaptive.batch_allows(batch.reqs, count=False)):
            return False
        return any(self.adaptive.resumes_within(r, TAPS_WARMUP) for r in batch.reqs)

    def start(self, batch: ScheduledBatch) -> None:
        """Before the forward: each request's rows and first position."""
        offsets = [0, *itertools.accumulate(batch.num_new_tokens)]
        self.rows = [(r, offsets[i], r.num_computed_tokens) for i, r in enumerate(batch.reqs)]

    def hand_over(self, drafter: Drafter, hidden: torch.Tensor | None) -> float:
        """After sampling: the rows each request committed to the drafter's `on_context`;
        returns the seconds it took."""
        if not self.rows:
            return 0.0
        assert hidden is not None, "a tapped forward returns its taps"
        started = time.perf_counter()
        for req, row, start in self.rows:
            if not req.is_finished and req.num_computed_tokens > start:
                drafter.on_context(req, hidden[row:row + req.num_computed_tokens - start],
                                        start)
        self.rows = []
        seconds = time.perf_counter() - started
        self.seconds = (1 - CONTEXT_EMA) * self.seconds + CONTEXT_EMA * seconds
        return seconds
