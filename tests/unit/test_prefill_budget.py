"""The ITL target's prompt budget: the step-cost fit against known costs, and the budget
it gives."""
import random

import pytest

from kdaserve.engine.prefill_budget import PrefillBudget
from kdaserve.engine_config import EngineConfig

A, B, C = 0.020, 0.004, 0.0005  # s a step, s a decode token, s a prompt token


def cost(decode: int, prompt: int) -> float:
    return A + B * decode + C * prompt


def test_fit_recovers_a_known_cost_and_budgets_the_target() -> None:
    rng = random.Random(0)
    budget = PrefillBudget(target_s=0.5, floor=16)
    assert budget.tokens(8) is None  # nothing seen: no cap of its own
    for _ in range(64):
        d, p = rng.choice([0, rng.randint(1, 64)]), rng.choice([0, rng.randint(16, 2048)])
        budget.observe(d, p, cost(d, p) * rng.uniform(0.98, 1.02))
    assert budget.coef is not None
    a, b, c = budget.coef
    assert a == pytest.approx(A, rel=0.25) and b == pytest.approx(B, rel=0.1)
    assert c == pytest.approx(C, rel=0.05)
    for d in (1, 8, 64):
        expected = (0.5 - A - B * d) / C
        assert budget.tokens(d) == pytest.approx(expected, rel=0.08)
        # a step of that size lands on the target
        assert cost(d, budget.tokens(d)) == pytest.approx(0.5, rel=0.05)
    assert budget.tokens(8) > budget.tokens(64)  # more decodes, fewer prompt tokens


def test_decodes_alone_over_the_target_leave_the_floor() -> None:
    budget = PrefillBudget(target_s=0.05, floor=16)
    for i in range(16):
        d, p = [(32, 0), (0, 512), (4, 100)][i % 3]
        budget.observe(d, p, cost(d, p))
    assert budget.tokens(32) == 16  # 0.148 s of decodes alone: prompts still progress
    assert budget.tokens(1) == pytest.approx((0.05 - A - B) / C, abs=3)


def test_one_step_charges_it_all_to_its_tokens() -> None:
    """Before any step there is no fit (no cap of its own). After one step of one size the
    costs cannot be told apart: the priors charge the whole step to its tokens (no fixed
    cost) and a decode token as a prompt token, until steps of other sizes say otherwise."""
    budget = PrefillBudget(target_s=0.5, floor=16)
    assert budget.tokens(8) is None
    budget.observe(0, 2048, cost(0, 2048))
    per_token = cost(0, 2048) / 2048
    for d in (1, 8, 32):
        assert budget.tokens(d) == pytest.approx(0.5 / per_token - d, rel=0.01)


def test_decode_only_steps_charge_prompt_tokens_as_decodes() -> None:
    budget = PrefillBudget(target_s=0.05, floor=16)
    for d in range(1, 24):
        budget.observe(d, 0, cost(d, 0))
    assert budget.coef is not None and budget.tokens(8) is not None
    # every token was a decode token: c is a decode token's cost, charged to prompt tokens too
    assert budget.tokens(2) < (0.05 - A - B * 2) / C


def test_window_follows_a_changed_cost() -> None:
    """Costs drift (contexts lengthen, other load): the window forgets the old ones."""
    budget = PrefillBudget(target_s=0.5, floor=16, window=32)
    rng = random.Random(1)
    for scale in (1.0, 3.0):
        for _ in range(32):
            d, p = rng.randint(0, 64), rng.randint(0, 2048)
            budget.observe(d, p, scale * cost(d, p))
    assert budget.tokens(8) == pytest.approx((0.5 - 3 * (A + 8 * B)) / (3 * C), rel=0.05)


@pytest.mark.parametrize("target", [0.0, -5.0, float("nan"), float("inf")])
def test_target_must_be_finite_and_positive(target: float) -> None:
    with pytest.raises(ValueError, match="itl_target_ms"):
        EngineConfig(model="tiny", itl_target_ms=target)
    with pytest.raises(ValueError, match="ITL target"):
        PrefillBudget(target_s=target, floor=16)


@pytest.mark.parametrize("other", [{"disaggregation_mode": "prefill"},
                                   {"disaggregation_mode": "decode"},
                                   {"enable_dp_attention": True, "dp_size": 2}])
def test_target_refused_where_it_could_not_act(other: dict) -> None:
    """A prefill or decode server never runs both kinds of token in a step, and a DP
    attention rank's step waits on tokens it does not count: refused, not ignored."""
    with pytest.raises(ValueError, match="itl_target_ms does not combine"):
        EngineConfig(model="tiny", itl_target_ms=500, **other)


def test_a_huge_target_gives_a_capped_budget() -> None:
    budget = PrefillBudget(target_s=1e12, floor=16)
    budget.observe(0, 2048, 1e-9)
    assert budget.tokens(4) == 1 << 30  # no float too large for int()
