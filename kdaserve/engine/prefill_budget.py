"""How many prompt tokens a step may take beside running decodes, chosen so the step stays
within an inter-token-latency target.

Every decoding stream waits for the whole step, so a step's wall time is each stream's
inter-token latency (ITL). A fixed cap (`max_prefill_tokens_with_decodes`) is right for one
load only: 512 tokens is a short step beside 4 decodes and a long one beside 64, and the
right number differs by model and machine. Here the step's cost is learned from the steps
the engine runs: wall time ~ a + b * decode tokens + c * prompt tokens, a least-squares fit
(non-negative, with priors where the steps cannot tell the costs apart) over a window of
recent steps, refitted when a budget is asked for after new steps. The budget is what the
target leaves after the decodes' share, divided by the cost of a prompt token.

Attention grows with context, which the linear model leaves to the window: as contexts
lengthen, a and b drift up and the budget down with them.
"""
from __future__ import annotations

import numpy as np

# pull toward the priors (scaled columns) where the steps cannot tell the costs apart: a = 0
# (with steps of one size only, a cold wave's full chunks, the smallest intercept is the
# cautious answer: every second charged to the tokens, short budgets) and a decode token
# costing what a prompt token does; once the sizes vary the data decides
PRIOR_RIDGE = 1e-3


class PrefillBudget:
    def __init__(self, target_s: float, floor: int, window: int = 128) -> None:
        if not 0 < target_s < float("inf"):
            raise ValueError(f"the ITL target must be > 0, got {target_s}")
        self.target_s = target_s
        # a prompt always progresses: however slow the decodes alone, a step still takes this
        # many of its tokens (one block; no prompt starves behind a full decode batch)
        self.floor = floor
        # the window as a ring of (decode tokens, prompt tokens, seconds) rows: least squares
        # does not care about their order
        self.steps = np.zeros((window, 3))
        self.num_steps = 0
        self._coef: tuple[float, float, float] | None = None  # (a, b, c) of the last fit
        self._stale = False

    def observe(self, decode_tokens: int, prompt_tokens: int, seconds: float) -> None:
        """One step's measured wall time (from schedule to sampled tokens). Only recorded:
        the fit runs when a budget is asked for (a decode-only stretch costs no solves)."""
        self.steps[self.num_steps % len(self.steps)] = (decode_tokens, prompt_tokens, seconds)
        self.num_steps += 1
        self._stale = True

    @property
    def coef(self) -> tuple[float, float, float] | None:
        """(a, b, c) fitted on the window; None before any step (the fit uses the first
        one: the priors below err short)."""
        if self._stale:
            self._fit()
        return self._coef

    def _fit(self) -> None:
        self._stale = False
        data = self.steps[:min(self.num_steps, len(self.steps))]
        d, p, t = data[:, 0], data[:, 1], data[:, 2]
        # fitted as t = a + c (d + p) + e d: every token costs c, a decode token e more (the
        # lm_head row, attention over its context), so that the prior e = 0 is a sensible
        # answer while decode and prompt counts have barely varied apart (a handful of steps)
        x = np.column_stack([np.ones(len(data)), d + p, d])
        scale = np.maximum(np.abs(x).max(axis=0), 1.0)  # counts are 1e0..1e4 against 1
        xs = x / scale
        ridge = len(data) * np.array([PRIOR_RIDGE, 1e-6, PRIOR_RIDGE])
        # no cost is negative: a column whose coefficient comes out below 0 (noise, or a
        # column that never varied) is dropped and the rest refitted
        keep = [0, 1, 2]
        while True:
            sub = xs[:, keep]
            coef = np.linalg.solve(sub.T @ sub + np.diag(ridge[keep]), sub.T @ t)
            if len(keep) == 1 or coef.min() >= 0:
                break
            del keep[int(np.argmin(coef))]
        full = np.zeros(3)
        full[keep] = coef / scale[keep]
        a, c, e = (float(v) for v in full)
        # a token that costs nothing gives no budget to trust: the last fit stands
        if c > 0:
            self._coef = (a, c + e, c)

    def tokens(self, decode_tokens: int) -> int | None:
        """Prompt tokens a step with this many decode tokens may take; None while the cost
        is not known (the caller's other limits apply alone)."""
        if self.coef is None:
            return None
        a, b, c = self.coef
        room = self.target_s - a - b * decode_tokens
        # capped before int(): a tiny fitted cost would make an enormous float
        return max(self.floor, int(min(room / c, 1 << 30))) if room > 0 else self.floor
