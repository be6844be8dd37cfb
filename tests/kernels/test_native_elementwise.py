"""The native row-wise ops (csrc/elementwise_cpu.cpp) against torch: the RMSNorm (rows may be
a column slice) and the greedy pick `argmax_rows`."""

from __future__ import annotations

import pytest
import torch


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("shape", [(1, 64), (7, 3, 40), (300, 768)])
def test_rms_norm_native_matches_reference(shape: tuple[int, ...]) -> None:
    from kdaserve.kernels import rms_norm_native, rms_norm_ref

    g = gen(5)
    x, w = torch.randn(*shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    torch.testing.assert_close(rms_norm_native(x, w, 1e-5), rms_norm_ref(x, w, 1e-5),
                               atol=1e-5, rtol=1e-5)
    xb, wb = x.bfloat16(), w.bfloat16()  # not fp32: the reference runs
    torch.testing.assert_close(rms_norm_native(xb, wb, 1e-5), rms_norm_ref(xb, wb, 1e-5))
    wide = torch.randn(x.numel() // shape[-1], shape[-1] + 9, generator=g)
    cols = wide[:, 3:3 + shape[-1]]  # a column slice (MLA's latent part of kv_a's output)
    torch.testing.assert_close(rms_norm_native(cols, w, 1e-5), rms_norm_ref(cols, w, 1e-5),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (3, 8), (5, 9), (16, 4096), (4, 100003)])
def test_argmax_rows_matches_torch(shape: tuple[int, int]) -> None:
    from kdaserve.kernels import argmax_rows

    g = gen(11)
    x = torch.randn(*shape, generator=g)
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    ties = torch.randint(0, 3, shape, generator=g).float()  # many equal maxima: the first
    assert torch.equal(argmax_rows(ties), ties.argmax(-1))


def test_argmax_rows_edge_rows() -> None:
    """All -inf (a fully masked row), NaNs (the first wins, as in torch), strided input."""
    from kdaserve.kernels import argmax_rows

    x = torch.zeros(4, 40)
    x[1, 5] = x[1, 30] = 1.0
    x[2] = float("-inf")
    x[3, 9] = x[3, 20] = float("nan")
    assert argmax_rows(x).tolist() == x.argmax(-1).tolist() == [0, 5, 0, 9]
    wide = torch.randn(6, 50, generator=gen(12))[:, 5:45]  # not contiguous: torch's own
    assert torch.equal(argmax_rows(wide), wide.argmax(-1))
    assert torch.equal(argmax_rows(wide.bfloat16()), wide.bfloat16().argmax(-1))
