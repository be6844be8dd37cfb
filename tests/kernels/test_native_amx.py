"""bf16 weights on AMX tiles (csrc/amx_cpu.cpp), against float64 arithmetic on the same bf16
values: the activations' two-part bf16 split keeps the products within 2^-16 of exact, far
inside the error of rounding the activations to bf16 (which the test shows the kernel does
not do). Skipped where the host has no AMX (AVX2 hosts, AMD): ops.amx() is then False and
bf16 products take the widening paths, which test_native.py covers."""

from __future__ import annotations

import pytest
import torch

from kdaserve.kernels.native import ops

pytestmark = pytest.mark.skipif(not ops.amx(), reason="no AMX tiles on this host")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def amx_linear(x: torch.Tensor, w: torch.Tensor, team: int = 1) -> torch.Tensor:
    """team 1: over the OpenMP team; 0: on the calling thread (an expert block's product)."""
    y = torch.empty(x.shape[0], w.shape[0])
    rc = ops.library().linear_amx_bf16w(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.shape[0],
                                        w.shape[0], x.shape[1], team)
    assert rc == 0
    return y


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per output: the split's 2^-17 relative error on each activation, plus fp32 sums over
    K terms, as a multiple of sum_k |x_k w_k|."""
    K = x.shape[1]
    return (2.0**-16 + K * 2.0**-23) * (x.double().abs() @ w.double().abs().t())


@pytest.mark.parametrize(("M", "N", "K"), [(1, 1, 32), (5, 17, 40), (16, 130, 768),
                                           (33, 64, 70), (100, 33, 256), (300, 96, 128)])
def test_amx_product_is_fp32_class_on_bf16_weights(M: int, N: int, K: int) -> None:
    """Shapes with partial tiles everywhere: rows past M, weight rows past N (the panel is
    padded), K not a whole 32-value chunk (padded), and several passes of activation
    columns (300 rows)."""
    g = gen(M * N + K)
    x = torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 4
    w = torch.randn(N, K, generator=g).bfloat16()
    exact = x.double() @ w.double().t()
    err = (amx_linear(x, w).double() - exact).abs()
    assert bool((err <= bound(x, w)).all()), float((err / bound(x, w)).max())
    # the low part is there: rounding the activations to bf16 would err far more
    rounded = (x.bfloat16().double() @ w.double().t() - exact).abs()
    assert float(err.max()) < 0.05 * float(rounded.max())
    # on one thread the same operations: the same bits
    assert torch.equal(amx_linear(x, w, team=0), amx_linear(x, w))


def test_amx_reads_nothing_past_the_weight() -> None:
    """The weight's last panel is partial and K ends mid-chunk: the kernel must not read the
    memory after it (NaN here, which a zero activation would not cancel)."""
    N, K, M = 20, 50, 16
    g = gen(1)
    buf = torch.full((N * K + 4096,), float("nan"), dtype=torch.bfloat16)
    w = buf[: N * K].view(N, K)
    w.copy_(torch.randn(N, K, generator=g))
    x = torch.randn(M, K, generator=g)
    y = amx_linear(x, w)
    assert bool(torch.isfinite(y).all())
    exact = x.double() @ w.double().t()
    assert bool(((y.double() - exact).abs() <= bound(x, w)).all())


@pytest.mark.parametrize("rows", [8, 16, 64, 700])
def test_linear_native_runs_bf16_weights_on_amx_at_any_row_count(
        rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """`linear_native` keeps bf16 weights native at every row count (no widened copy for
    oneDNN), and the native call takes the tiles from 16 rows (8 for an lm_head-sized
    weight): its result is then the AMX product's, bit for bit."""
    from tests.kernels.test_native import spy_on_native_calls

    assert ops.linear_native_max_rows(torch.empty(4, 4, dtype=torch.bfloat16)) >= 2**40
    g = gen(rows)
    x = torch.randn(rows, 96, generator=g)
    w = torch.randn(80, 96, generator=g).bfloat16()
    calls = spy_on_native_calls(monkeypatch)
    y = ops.linear_native(x, w)
    assert calls == ["linear_small_bf16w"]
    monkeypatch.undo()
    if rows >= 16:
        assert torch.equal(y, amx_linear(x, w))
    exact = x.double() @ w.double().t()
    assert bool(((y.double() - exact).abs() <= bound(x, w)).all())
