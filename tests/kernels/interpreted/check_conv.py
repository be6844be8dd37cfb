"""Run by tests/kernels/test_triton_interpreted.py under Triton's interpreter: KDA's short
conv kernels against `short_conv_ref` on ragged batches (decodes, verifies, prefills shorter
and longer than the window), scattered slots, the pool's other slots untouched."""

from __future__ import annotations

import pytest
import torch

from kdaserve.kernels.ref.kda import short_conv_ref
from kdaserve.kernels.triton.conv import short_conv_triton


@pytest.mark.parametrize("lengths,W", [([1, 1, 1], 4), ([1, 2, 5, 12], 4), ([3, 1], 2),
                                       ([7], 3)])
def test_short_conv_matches_reference(lengths: list[int], W: int) -> None:
    g = torch.Generator().manual_seed(sum(lengths) + W)
    D, N = 200, 9  # channels past one block of 128
    T = sum(lengths)
    x, weight = torch.randn(T, D, generator=g), torch.randn(D, W, generator=g)
    pool = torch.randn(N, W - 1, D, generator=g)
    slots = torch.randperm(N, generator=g)[:len(lengths)]
    cu = torch.tensor([0, *lengths]).cumsum(0)
    want_pool = pool.clone()
    want = short_conv_ref(x, weight, want_pool, slots, cu)
    got = short_conv_triton(x, weight, pool, slots, cu)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert torch.equal(pool, want_pool)  # new states, and every other slot as it was
