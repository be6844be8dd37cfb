"""How many prompt tokens a step may take beside running decodes, chosen so the step stays
within an inter-token-latency target.

Every decoding stream waits for the whole step, so a step's wall time is each stream's
inter-token latency (ITL). A fixed cap (`max_prefill_tokens_with_decodes`) is right for one
load only: 512 tokens is a short step beside 4 decodes and a long one beside 64, and the
right number differs by model and machine. Here the step's cost is learned from the steps
the engine runs: wall time ~ a + b * decode tokens + c * prompt tokens, a least-squares fit
over a window of recent steps, refitted every few steps. The budget is what the target
leaves after the decodes' share, divided by the cost of a prompt token.

Attention grows with context, which the linear model leaves to the window: as contexts
lengthen, a and b drift up and the budget down with them.
"""
from __future__ import annotations

from collections import deque

import numpy as np

MIN_STEPS = 8  # steps seen before the fit is trusted (no cap before)
REFIT_EVERY = 4


class PrefillBudget:
    def __init__(self, target_s: float, floor: int, window: int = 128) -> None:
        if not target_s > 0:
            raise ValueError(f"the ITL target must be > 0, got {target_s}")
        self.target_s = target_s
        # a prompt always progresses: however slow the decodes alone, a step still takes this
        # many of its tokens (one block; no prompt starves behind a full decode batch)
        self.floor = floor
        self.steps: deque[tuple[int, int, float]] = deque(maxlen=window)
        self.coef: tuple[float, float, float] | None = None  # (a, b, c) once fitted
        self._since_fit = 0

    def observe(self, decode_tokens: int, prompt_tokens: int, seconds: float) -> None:
        """One step's measured wall time (from schedule to sampled tokens)."""
        self.steps.append((decode_tokens, prompt_tokens, seconds))
        self._since_fit += 1
        if len(self.steps) >= MIN_STEPS and self._since_fit >= REFIT_EVERY:
            self._fit()

    def _fit(self) -> None:
        self._since_fit = 0
        data = np.asarray(self.steps, dtype=np.float64)
        x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        # scaled columns (token counts are 1e0..1e4 against a column of ones) and a small
        # ridge, so steps that never vary one column (only decodes so far) give that column
        # a coefficient near 0 instead of an arbitrary one
        scale = np.maximum(np.abs(x).max(axis=0), 1.0)
        xs = x / scale
        ridge = 1e-6 * len(data)
        coef = np.linalg.solve(xs.T @ xs + ridge * np.eye(3), xs.T @ data[:, 2]) / scale
        a, b, c = (float(v) for v in coef)
        # a prompt token that costs nothing (a fit that has seen no prompt beside decodes
        # at varied sizes) gives no budget to trust
        self.coef = (a, max(b, 0.0), c) if c > 0 else None

    def tokens(self, decode_tokens: int) -> int | None:
        """Prompt tokens a step with this many decode tokens may take; None while the cost
        is not known (the caller's other limits apply alone)."""
        if self.coef is None:
            return None
        a, b, c = self.coef
        room = self.target_s - a - b * decode_tokens
        return max(self.floor, int(room / c)) if room > 0 else self.floor
