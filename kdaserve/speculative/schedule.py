"""How many drafts each request verifies this step: as many as raise the batch's tokens per
second, by a cost model of the step fitted to its own timings.

A step that runs T tokens (decodes plus drafts), V of its requests verifying drafts, takes
about t = a + b T + c V: `a` is what every step pays whatever its size (reading the weights
once, the host's work, drafting), `b` what each token adds (its FLOPs, its experts, its
attention), `c` what each verifying request adds on top (its state saved and restored, its
step record replayed, its acceptance). A step whose requests are expected to emit E tokens
yields E / t tokens a second. Without c, one more draft whose chance of surviving (it and
every draft before it accepted) is p raises that rate exactly when
    p > b E / (a + b T),
i.e. when p beats the marginal token's share of the step times what the step yields. While
the batch is small (T << a / b: weight-bound) that bar is low and long blocks pay; as the
batch grows it rises towards 1 and drafting stops paying: the schedule backs off under load
by itself, on any machine, with no batch-size threshold to tune (and the `Speculator` skips
drafting altogether while not even a typical first draft would clear the bar). With c a
request's first draft costs b + c and its later ones b, so a first draft may pay only with
the ones after it; `choose_lengths` maximises the rate exactly by Dinkelbach's iteration
(at the current rate r, each request independently takes the prefix length maximising
gain - r cost; the new rate is higher unless the choice is already optimal).

`StepCost` fits a, b and c by exponentially weighted least squares over the engine's decode
and verify steps (prefill chunks are another regime and are not fed to it). Until the steps
seen vary in size enough to separate a from b it assumes c = 0 and that a step of
PRIOR_TOKENS tokens costs twice a one-token step: the weight-bound regime of a small batch on
a CPU. Verify lengths
then depend on timings, so a seeded sampled request that speculates is reproducible only
as far as its batches are (as with any batch-dependent kernel); greedy output never changes.
"""

from __future__ import annotations

import math

PRIOR_TOKENS = 8.0  # tokens at which a step costs twice a 1-token step, until fitted
DECAY = 0.99  # weight of the past per observed step: ~100 steps of memory
MIN_SPREAD = 0.5  # variance of the observed step sizes (tokens^2) needed to fit the slope
MIN_VERIFY_SPREAD = 0.05  # ... and of the verifying requests per step, to fit c
A_FLOOR = 0.05  # least share of a mean step the fitted fixed part may have
MAX_ROUNDS = 32  # Dinkelbach rounds (it converges in a few)


class StepCost:
    """t = a + b T + c V from (tokens, verifying requests, seconds) observations; only
    b / a and c / a matter to the schedule, so the prior needs no unit."""

    def __init__(self, fitted: bool = True, prior_tokens: float = PRIOR_TOKENS) -> None:
        self.fitted, self.prior_tokens = fitted, prior_tokens
        # weighted sums of 1, T, V, y, TT, TV, VV, Ty, Vy
        self.sums = [0.0] * 9
        self.num_observed = 0

    def observe(self, tokens: int, verifies: int, seconds: float) -> None:
        if not self.fitted:
            return
        t, v, y = float(tokens), float(verifies), seconds
        row = (1.0, t, v, y, t * t, t * v, v * v, t * y, v * y)
        self.sums = [DECAY * s + x for s, x in zip(self.sums, row, strict=True)]
        self.num_observed += 1

    def ratios(self) -> tuple[float, float]:
        """(b / a, c / a): what one more token and one more verifying request cost, as
        shares of a step's fixed part."""
        prior = (1.0 / self.prior_tokens, 0.0)
        w, st, sv, sy, stt, stv, svv, sty, svy = self.sums
        if w == 0:
            return prior
        mt, mv, my = st / w, sv / w, sy / w
        var_t, var_v = stt / w - mt * mt, svv / w - mv * mv
        cov_tv, cov_ty, cov_vy = stv / w - mt * mv, sty / w - mt * my, svy / w - mv * my
        if var_t < MIN_SPREAD:
            return prior
        b, c = cov_ty / var_t, 0.0
        det = var_t * var_v - cov_tv * cov_tv
        if var_v >= MIN_VERIFY_SPREAD and det > 1e-6 * var_t * var_v:
            b2 = (cov_ty * var_v - cov_vy * cov_tv) / det
            c2 = (var_t * cov_vy - cov_tv * cov_ty) / det
            if c2 > 0 and b2 >= 0:  # else: noise, keep the one-term fit
                b, c = b2, c2
        b = max(b, 0.0)  # noise: more tokens never cost less
        # a step always has a fixed part (the host's work, reading the weights once); a fit
        # that says otherwise is noise (a stalled step, a busy machine), so a is kept at
        # A_FLOOR of a mean step or more, and the ratios stay finite
        a = max(my - b * mt - c * mv, A_FLOOR * my)
        return b / a, c / a


def choose_lengths(survival: list[list[float]], token_ratio: float, base_tokens: int,
                   verify_ratio: float = 0.0) -> list[int]:
    """Drafts each request verifies. survival[i][j]: the chance that request i's drafts 0..j
    are all accepted (non-increasing in j). base_tokens: the step's tokens before any draft
    (every decoding request's own, those that do not draft included, each expected to
    emit one). Costs are in units of a: t = 1 + token_ratio T + verify_ratio V."""
    lengths = [0] * len(survival)
    if math.isinf(token_ratio) or math.isinf(verify_ratio):
        return lengths

    def rate(ns: list[int]) -> float:
        gain = sum(sum(s[:n]) for s, n in zip(survival, ns, strict=True))
        cost = 1 + token_ratio * (base_tokens + sum(ns)) + verify_ratio * sum(n > 0 for n in ns)
        return (base_tokens + gain) / cost

    best = rate(lengths)
    for _ in range(MAX_ROUNDS):
        chosen = []
        for s in survival:
            top, top_n, gain = 0.0, 0, 0.0
            for n, p in enumerate(s, 1):
                gain += p
                value = gain - best * (token_ratio * n + verify_ratio)
                if value > top:
                    top, top_n = value, n
            chosen.append(top_n)
        r = rate(chosen)
        if r <= best:
            break
        lengths, best = chosen, r
    return lengths
