"""The verify-length schedule (speculative/schedule.py): the greedy choice equals a brute
force over every combination of prefix lengths, hand-checked cases, the step-cost fit, and
the decision to draft at all (drafting's own cost included) against a brute force."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from kdaserve.speculative.schedule import (
    A_FLOOR,
    PRIOR_TOKENS,
    StepCost,
    choose_lengths,
    plan_drafting,
)


def rate(survival: list[list[float]], lengths: list[int] | tuple[int, ...], ratio: float,
         base: int, fixed: float = 1.0) -> float:
    """Expected tokens per second (in units of a step's fixed cost) for these lengths."""
    emitted = base + sum(sum(s[:n]) for s, n in zip(survival, lengths, strict=True))
    return emitted / (fixed + ratio * (base + sum(lengths)))


def test_hand_cases() -> None:
    s = [0.9, 0.72, 0.36, 0.324]  # confidences 0.9, 0.8, 0.5, 0.9 multiplied up
    r = 1 / 8
    # alone: bars 0.111, 0.19, 0.238, 0.248: every draft pays
    assert choose_lengths([s], r, 1) == [4]
    # beside 15 other decodes: bars 0.667, 0.676, 0.678: two pay
    assert choose_lengths([s], r, 16) == [2]
    assert choose_lengths([s, s], r, 64) == [1, 1]  # bar 0.889 < 0.9
    assert choose_lengths([s, s], r, 128) == [0, 0]  # bar 0.941
    assert choose_lengths([s], 0.0, 1) == [4]  # tokens free: all
    assert choose_lengths([s], math.inf, 1) == [0]  # only tokens cost: none
    assert choose_lengths([[], s], r, 2) == [0, 4]


def test_greedy_is_optimal() -> None:
    rng = random.Random(0)
    for _ in range(300):
        n, k = rng.randint(1, 3), rng.randint(1, 4)
        survival = []
        for _ in range(n):
            p, s = 1.0, []
            for _ in range(k):
                p *= rng.random() ** 0.3
                s.append(p)
            survival.append(s)
        ratio = rng.choice([0.01, 0.1, 0.3, 1.0, 3.0])
        base = n + rng.randint(0, 6)
        got = choose_lengths(survival, ratio, base)
        best = max(rate(survival, c, ratio, base)
                   for c in itertools.product(range(k + 1), repeat=n))
        assert rate(survival, got, ratio, base) == pytest.approx(best, rel=1e-12)


def test_step_cost_fit() -> None:
    cost = StepCost()
    assert cost.slope_ratio() == 1 / PRIOR_TOKENS  # nothing seen
    for _ in range(50):
        cost.observe(4, 0.01)
    assert cost.slope_ratio() == 1 / PRIOR_TOKENS  # one size only: a and b not separable
    rng = random.Random(1)
    for _ in range(400):  # t = 2 ms + 0.5 ms a token, 2% noise
        t = rng.randint(1, 40)
        cost.observe(t, (2e-3 + 5e-4 * t) * rng.uniform(0.98, 1.02))
    assert cost.slope_ratio() == pytest.approx(0.25, rel=0.1)
    flat = StepCost()
    for t in (1, 8, 1, 8):
        flat.observe(t, 0.01 - 1e-4 * t)  # larger steps timed faster: noise, not a model
    assert flat.slope_ratio() == 0.0
    steep = StepCost()
    for t in (1, 9, 1, 9):
        steep.observe(t, 1e-3 * t - 5e-4)  # intercept < 0: a stalled big step, not a model
    mean_y = 4.5e-3
    # (the weighted mean leans to the latest steps: within 2%)
    assert steep.slope_ratio() == pytest.approx(1e-3 / (A_FLOOR * mean_y), rel=0.02)
    frozen = StepCost(fitted=False, prior_tokens=2)
    frozen.observe(1, 1.0)
    frozen.observe(9, 9.0)
    assert frozen.num_observed == 0 and frozen.slope_ratio() == 0.5


def test_fit_in_seconds() -> None:
    """fit() gives a and b in seconds, consistent with slope_ratio; at the prior, a is what
    the prior makes of the mean step."""
    cost = StepCost()
    assert cost.fit() is None
    for _ in range(10):
        cost.observe(8, 0.02)
    a, b = cost.fit()  # type: ignore[misc]
    assert a == pytest.approx(0.01) and b / a == pytest.approx(1 / PRIOR_TOKENS)
    for t in (4, 12) * 200:  # t = 6 ms + 1 ms a token
        cost.observe(t, 6e-3 + 1e-3 * t)
    a, b = cost.fit()  # type: ignore[misc]
    assert a == pytest.approx(6e-3, rel=0.01) and b == pytest.approx(1e-3, rel=0.01)
    assert cost.slope_ratio() == pytest.approx(b / a)


def test_plan_drafting_hand_cases() -> None:
    s = [0.9, 0.72, 0.36, 0.324]
    r = 1 / 8
    assert plan_drafting(s, 1, r, 1, 0.0) == 4  # free drafting: choose_lengths' answer
    assert plan_drafting(s, 1, r, 16, 0.0) == 2
    assert plan_drafting(s, 2, r, 128, 0.0) == 0
    # alone, a pass costing 3 fixed parts: plain 1 / 1.125 = 0.89 tokens per a, drafting
    # all four 3.30 / 4.625 = 0.71: not worth it; at half a fixed part it is (1.57)
    assert plan_drafting(s, 1, r, 1, 3.0) == 0
    assert plan_drafting(s, 1, r, 1, 0.5) == 4
    # 16 requests at b/a = 0.05: two drafts each pay (bars 0.444, then 0.616 > 0.36), for
    # 41.9 tokens in 3.4 fixed parts (12.3 a part, plain 16 / 1.8 = 8.9); a pass costing
    # 2 fixed parts brings that to 41.9 / 5.4 = 7.8: drafting stops
    assert plan_drafting(s, 16, 0.05, 16, 1.0) == 2
    assert plan_drafting(s, 16, 0.05, 16, 2.0) == 0


def test_plan_drafting_equals_brute_force() -> None:
    """Drafting is planned iff some set of lengths, the drafting pass paid, beats a plain
    step; and the planned length is the longest of the best such set."""
    rng = random.Random(2)
    planned = 0
    for _ in range(300):
        k, n = rng.randint(1, 4), rng.randint(1, 3)
        p, typical = 1.0, []
        for _ in range(k):
            p *= rng.random() ** 0.3
            typical.append(p)
        ratio = rng.choice([0.01, 0.1, 0.3, 1.0])
        base, cost = n + rng.randint(0, 6), rng.choice([0.0, 0.1, 0.5, 2.0])
        got = plan_drafting(typical, n, ratio, base, cost)
        plain = base / (1 + ratio * base)
        best = max(itertools.product(range(k + 1), repeat=n),
                   key=lambda c: rate([typical] * n, c, ratio, base, 1 + cost))
        pays = any(best) and rate([typical] * n, best, ratio, base, 1 + cost) > plain
        assert got == (max(best) if pays else 0), (typical, n, ratio, base, cost)
        planned += got > 0
    assert 30 < planned < 270  # both outcomes exercised


def test_drafter_confidences_are_calibrated_by_what_verification_keeps() -> None:
    """A drafter that says 0.9 / 0.72 for drafts kept 60% / 30% of the time: the speculator's
    survival estimates move from the drafter's towards the kept rates (the prior holds them
    at the drafter's until verifies accumulate) and stay non-increasing by position."""
    from kdaserve.speculative.survival import SurvivalRecord

    own = [0.9, 0.72]
    record = SurvivalRecord()
    assert record.estimate(2, own) == own
    outcomes = [2] * 3 + [1] * 3 + [0] * 4  # kept: position 0 in 6 of 10, position 1 in 3
    for _ in range(300):
        for j in outcomes:
            record.calibrate(own, j)
    s = record.estimate(2, own)
    assert s[0] == pytest.approx(0.6, abs=0.02) and s[1] == pytest.approx(0.3, abs=0.02)
    record.calibrate([0.5, 0.5], 2)
    assert record.calibration(0) < 1 and s[1] <= s[0]
    # without its own estimates: the record by position, one kept verify assumed
    record.verified(2, 1, None)
    assert record.estimate(3, None) == [1.0, 0.5, 0.5]


def test_explorations_are_budgeted() -> None:
    """An exploration waits EXPLORE_AFTER skipped steps, then its warm-up steps (taps on,
    not drafted), then EXPLORE_STEPS exploring steps; what it cost beyond plain steps of
    the same batch (drafting passes, slower steps) sets how much plain decode time must pass
    before the next: 1 / EXPLORE_SHARE times as much."""
    from kdaserve.speculative import explore
    from kdaserve.speculative.explore import Explorer

    e = Explorer(warmup_steps=2)
    plain = 0.010  # a plain step of 4 requests
    for _ in range(explore.EXPLORE_AFTER - 1):
        assert not e.due(explore.EXPLORE_AFTER - 1)  # too few skips, whatever the budget
        e.observe(4, plain, drafted=False, tapped=False)
    assert e.plain_step[4] == pytest.approx(plain) and not e.active
    # the first exploration: no cost seen yet, so it starts at EXPLORE_AFTER skips
    phases = []
    for _ in range(2):  # warm-up: taps on, no drafts, each step 5 ms slower
        phases.append(e.due(explore.EXPLORE_AFTER))
        e.observe(4, plain + 0.005, drafted=False, tapped=True)
    for _ in range(explore.EXPLORE_STEPS):  # each: a 20 ms drafting pass, 30 ms slower
        phases.append(e.due(0))
        e.spend(0.020)
        e.observe(4, plain + 0.030, drafted=True, tapped=True)
    assert phases == [False] * 2 + [True] * explore.EXPLORE_STEPS and not e.active
    cost = 2 * 0.005 + explore.EXPLORE_STEPS * 0.050
    assert e.cost == pytest.approx(cost) and e.num_explorations == explore.EXPLORE_STEPS
    # the next one waits for cost / EXPLORE_SHARE seconds of plain decoding, then warms up
    steps = 0
    while not e.due(explore.EXPLORE_AFTER):
        e.observe(4, plain, drafted=False, tapped=e.active)
        steps += 1
    assert abs(steps - (round(cost / explore.EXPLORE_SHARE / plain) + 2)) <= 1  # float sums
    e.stop()  # drafting pays: the exploration is over, and the budget starts again
    assert not e.active and e.plain_seconds == 0.0
    # a batch size never seen plain: its steps are measured against the nearest one seen
    e = Explorer()
    e.observe(4, plain, drafted=False, tapped=False)
    e.first_try()
    e.observe(6, plain + 0.020, drafted=True, tapped=False)
    # (a first try is one step: the budget counts a whole exploration of them)
    assert not e.active and e.cost == pytest.approx(explore.EXPLORE_STEPS * 0.020)


def test_a_standing_skip_replans_rarely_and_explorations_verify_a_draft(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A drafter whose record says every draft misses: the schedule skips, re-planning once
    per REPLAN_EVERY steps of the same batch (not every step), and each exploration step
    still verifies one draft (its record alone would verify none, and nothing would be
    learnt)."""
    from kdaserve.request import Request, SamplingParams
    from kdaserve.speculative import explore, verify
    from kdaserve.speculative.drafter import Drafter

    class Fixed(Drafter):
        k = 4

        def propose(self, reqs: list[Request]) -> None:
            for r in reqs:
                r.draft_ids = [1, 2, 3, 4][:self.max_draft_tokens(r)]

    plans = []
    real = verify.plan_drafting
    monkeypatch.setattr(verify, "plan_drafting", lambda *a: plans.append(a) or real(*a))
    spec = verify.Speculator(Fixed(), None, None)  # type: ignore[arg-type]
    record = spec.survival
    record.typical, record.drafted_at, record.accepted_at = [0.01] * 4, [99] * 4, [0] * 4
    req = Request("r", [5, 6, 7], SamplingParams(max_tokens=10_000))
    req.num_computed_tokens, req.output_ids = 3, [8]
    drafted = []
    steps = 400
    for _ in range(steps):
        spec.propose([req])
        drafted.append(len(req.draft_ids))
        spec.observe_step(1 + len(req.draft_ids), 0.001 + 0.01 * bool(req.draft_ids),
                          bool(req.draft_ids))
        req.draft_ids = []
    explored = [n for n in drafted if n]
    assert explored and set(explored) == {1}  # one draft, verified, per exploring step
    assert len(explored) % explore.EXPLORE_STEPS == 0
    assert len(plans) <= steps // verify.REPLAN_EVERY + 2 * len(explored) + 2
