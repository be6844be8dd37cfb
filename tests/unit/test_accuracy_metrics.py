"""`bench accuracy`'s measures against hand counts."""

from __future__ import annotations

import math

import pytest
import torch

from kdaserve.bench.accuracy import greedy_stats, logit_stats


def test_logit_stats_by_hand() -> None:
    ref = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    var = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    s = logit_stats(ref, var)
    assert s["max"] == 1.0 and s["abs_sum"] == 0.5 and s["rows"] == 2
    assert s["top1"] == 1  # row 0: argmax 0 against 1; row 1 agrees
    # row 0: KL([1/2, 1/2] || softmax([0, 1])) = ln((1 + e) / 2) - 1/2; row 1: 0
    assert s["kl_sum"] == pytest.approx(math.log((1 + math.e) / 2) - 0.5, abs=1e-12)
    same = logit_stats(ref, ref)
    assert same["max"] == same["abs_sum"] == same["kl_sum"] == 0 and same["top1"] == 2


def test_greedy_stats_by_hand() -> None:
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert greedy_stats(ref, [[1, 2, 9, 4], [5, 6, 7, 8]]) == (0.75, 0.5)  # (2 + 4) / 8
    assert greedy_stats(ref, [[0, 2, 3, 4], [5, 6, 7, 0]]) == (3 / 8, 0.0)
    assert greedy_stats(ref, ref) == (1.0, 1.0)
