"""How many drafts each request verifies this step: as many as raise the batch's tokens per
second, by a cost model of the step fitted to its own timings.

A step that runs T tokens (decodes plus drafts) takes about t(T) = a + b T: `a` is what every
step pays whatever its size (reading the weights once, the host's work), `b` what each token
adds (its FLOPs, its experts, its attention). A step whose requests are expected to emit E
tokens yields E / t(T) tokens a second. One more draft whose chance of surviving (it and every
draft before it accepted) is p raises that rate exactly when
    p > b E / (a + b T),
i.e. when p beats the marginal token's share of the step times what the step yields. While
the batch is small (T << a / b: weight-bound) that bar is low and long blocks pay; as the
batch grows it rises towards 1 and drafting stops paying: the schedule backs off under load
by itself, on any machine, with no batch-size threshold to tune. Taking candidates in
descending p and stopping at the first that fails the bar is optimal for a linear t (the
bar only rises as drafts are added, and the best set of n drafts is the n likeliest).

Drafting is timed apart from the step (it is not a cost of the tokens verified, and a model
drafter's pass at batch 16 costs as much as a third of the step): before drafting,
`plan_drafting` asks whether the drafts a step typically gets would pay for that pass too,
and how many per request are worth drafting at all.

`StepCost` fits a and b by exponentially weighted least squares over the engine's decode
and verify steps (prefill chunks are another regime and are not fed to it). Until the steps
seen vary in size enough to separate a from b it assumes a step of PRIOR_TOKENS tokens costs
twice a one-token step: the weight-bound regime of a small batch on a CPU. Verify lengths
then depend on timings, so a seeded sampled request that speculates is reproducible only
as far as its batches are (as with any batch-dependent kernel); greedy output never changes.
"""

from __future__ import annotations

import heapq
import math

PRIOR_TOKENS = 8.0  # tokens at which a step costs twice a 1-token step, until fitted
DECAY = 0.99  # weight of the past per observed step: ~100 steps of memory
MIN_SPREAD = 0.5  # variance of the observed step sizes (tokens^2) needed to fit the slope
A_FLOOR = 0.05  # least share of a mean step the fitted fixed part may have


class StepCost:
    """t(T) = a + b T from (tokens, seconds) observations; only b / a matters to the
    schedule, so the prior needs no unit."""

    def __init__(self, fitted: bool = True, prior_tokens: float = PRIOR_TOKENS) -> None:
        self.fitted, self.prior_tokens = fitted, prior_tokens
        self.w = self.st = self.sy = self.stt = self.sty = 0.0  # weighted sums
        self.num_observed = 0

    def observe(self, tokens: int, seconds: float) -> None:
        if not self.fitted:
            return
        d = DECAY
        self.w, self.st, self.sy = d * self.w + 1, d * self.st + tokens, d * self.sy + seconds
        self.stt = d * self.stt + tokens * tokens
        self.sty = d * self.sty + tokens * seconds
        self.num_observed += 1

    def fit(self) -> tuple[float, float] | None:
        """(a, b) in seconds, None before any observation. Until the step sizes seen vary
        enough, b / a is the prior's and a what that makes of the mean step."""
        if self.w == 0:
            return None
        mean_t, mean_y = self.st / self.w, self.sy / self.w
        var_t = self.stt / self.w - mean_t * mean_t
        if var_t < MIN_SPREAD:
            r = 1.0 / self.prior_tokens
            a = mean_y / (1 + r * mean_t)
            return a, a * r
        b = (self.sty / self.w - mean_t * mean_y) / var_t
        if b <= 0:  # noise: more tokens never cost less
            return mean_y, 0.0
        # a step always has a fixed part (the host's work, reading the weights once); a fit
        # that says otherwise is noise (a stalled step, a busy machine), so a is kept at
        # A_FLOOR of a mean step or more, and the ratio stays finite
        return max(mean_y - b * mean_t, A_FLOOR * mean_y), b

    def slope_ratio(self) -> float:
        """b / a: what one more token costs, as a share of a step's fixed part."""
        fit = self.fit()
        if fit is None:
            return 1.0 / self.prior_tokens
        return fit[1] / fit[0]


def choose_lengths(survival: list[list[float]], slope_ratio: float, base_tokens: int,
                   base_yield: float | None = None, fixed: float = 1.0) -> list[int]:
    """Drafts each request verifies. survival[i][j]: the chance that request i's drafts 0..j
    are all accepted (non-increasing in j). base_tokens: the step's tokens before any draft
    (every decoding request's own, those that do not draft included); base_yield: the tokens
    those are expected to emit (default: base_tokens). Costs are in units of a, so
    t(T) = fixed + slope_ratio T (fixed > 1: the step also pays for drafting)."""
    lengths = [0] * len(survival)
    if slope_ratio == math.inf:
        return lengths
    tokens, emitted = float(base_tokens), float(base_tokens if base_yield is None
                                                else base_yield)
    heap = [(-s[0], i) for i, s in enumerate(survival) if s]
    heapq.heapify(heap)
    while heap:
        neg_p, i = heapq.heappop(heap)
        p = -neg_p
        if p * (fixed + slope_ratio * tokens) <= slope_ratio * emitted:
            break
        lengths[i] += 1
        tokens += 1
        emitted += p
        if lengths[i] < len(survival[i]):
            heapq.heappush(heap, (-survival[i][lengths[i]], i))
    return lengths


def plan_drafting(typical: list[float], requests: int, slope_ratio: float, base_tokens: int,
                  draft_cost: float) -> int:
    """How many drafts per request are worth drafting this step (0: do not draft), for
    `requests` requests whose drafts survive as `typical` (recent proposals' mean survival
    by position) and a drafting pass that costs draft_cost (in units of a). Drafting pays
    when the step's expected tokens per second, drafting included, beat a plain step's."""
    lengths = choose_lengths([typical] * requests, slope_ratio, base_tokens,
                             fixed=1 + draft_cost)
    added = sum(lengths)
    if not added:
        return 0
    gain = sum(sum(typical[:n]) for n in lengths)
    drafted = (base_tokens + gain) / (1 + draft_cost + slope_ratio * (base_tokens + added))
    plain = base_tokens / (1 + slope_ratio * base_tokens)
    return max(lengths) if drafted > plain else 0
