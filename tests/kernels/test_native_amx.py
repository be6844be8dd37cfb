"""bf16 weights on AMX tiles (csrc/amx_cpu.cpp), against float64 arithmetic on the same bf16
values: the activations' two-part bf16 split keeps the products within 2^-16 of exact, far
inside the error of rounding the activations to bf16 (which the test shows the kernel does
not do); int8 weights (weight-only int8) and MXFP4 ones as exact bf16 panels on the same
tiles. Skipped where the host has no AMX (AVX2 hosts, AMD): ops.amx() is then False and the
products take the widening paths, which test_native.py and test_mxfp4.py cover."""

from __future__ import annotations

import pytest
import torch

from kdaserve.kernels.native import ops

from .conftest import bound, spy_on_native_calls

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


def amx_linear_int8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None,
                    team: int = 1) -> torch.Tensor:
    y = torch.empty(x.shape[0], w.shape[0])
    rc = ops.library().linear_amx_int8w(x.data_ptr(), w.data_ptr(),
                                        None if scale is None else scale.data_ptr(),
                                        y.data_ptr(), x.shape[0], w.shape[0], x.shape[1], team)
    assert rc == 0
    return y


@pytest.mark.parametrize(("M", "N", "K"), [(1, 1, 32), (5, 17, 40), (16, 130, 768),
                                           (33, 64, 70), (300, 96, 128)])
def test_amx_product_on_int8_weights_is_exact_bf16_panels(M: int, N: int, K: int) -> None:
    """int8 weights converted to bf16 panels on the way (exact: 8-bit integers), the same
    fp32-class bound as bf16 weights against float64 on the dequantized weights; the row
    scales applied after, or left to the caller (None)."""
    from kdaserve.kernels.ref.quant import dequantize, quantize_int8

    g = gen(M * N + K + 1)
    x = torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 4
    w, scale = quantize_int8(torch.randn(N, K, generator=g))
    deq = dequantize(w, scale, torch.float64)
    exact = x.double() @ deq.t()
    err = (amx_linear_int8(x, w, scale).double() - exact).abs()
    b = (2.0**-16 + K * 2.0**-23) * (x.double().abs() @ deq.abs().t())
    assert bool((err <= b).all()), float((err / b).max())
    unscaled = amx_linear_int8(x, w, None)
    assert bool(((unscaled.double() - x.double() @ w.double().t()).abs()
                 <= bound(x, w.bfloat16())).all())
    assert torch.equal(amx_linear_int8(x, w, scale, team=0), amx_linear_int8(x, w, scale))


@pytest.mark.parametrize("rows", [8, 16, 700])
def test_linear_native_runs_int8_weights_on_amx(rows: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 weights stay native at every row count (no dequantized copy for a GEMM) and take
    the tiles from 16 rows, bit for bit the AMX product's."""
    from kdaserve.kernels.ref.quant import dequantize, quantize_int8

    g = gen(rows + 7)
    x = torch.randn(rows, 96, generator=g)
    w, scale = quantize_int8(torch.randn(80, 96, generator=g))
    assert ops.linear_native_max_rows(w) >= 2**40
    calls = spy_on_native_calls(monkeypatch)
    y = ops.linear_native(x, w, scale)
    assert calls == ["linear_small_int8w"]
    monkeypatch.undo()
    if rows >= 16:
        assert torch.equal(y, amx_linear_int8(x, w, scale))
    deq = dequantize(w, scale, torch.float64)
    err = (y.double() - x.double() @ deq.t()).abs()
    assert bool((err <= (2.0**-16 + 96 * 2.0**-23) * (x.double().abs() @ deq.abs().t())).all())


def _quantized(fmt: str):
    """(quantize, dequantize(weight, scale, dtype)) of a weight format the tiles take."""
    from kdaserve.kernels.ref.mxfp4 import dequantize_mxfp4, quantize_mxfp4
    from kdaserve.kernels.ref.quant import dequantize, quantize_int8

    return {"int8": (quantize_int8, dequantize),
            "mxfp4": (quantize_mxfp4, dequantize_mxfp4)}[fmt]


@pytest.mark.parametrize("fmt", ["int8", "mxfp4"])
def test_quantized_experts_blocks_on_amx_equal_the_reference(fmt: str) -> None:
    """Experts with enough tokens run as AMX token blocks for int8 weights (their scales on
    the way out of each product, from 8 tokens) and MXFP4 ones (panels decoded to bf16, from
    16); against the reference on the dequantized weights in float64."""
    from kdaserve.kernels.ref.moe import moe_experts_ref

    quantize, dequantize = _quantized(fmt)
    if fmt == "int8":
        assert ops.moe_blocked_from(torch.int8) == ops.MOE_BLOCKED_FROM_AMX
    g = gen(3)
    E, inter, D, T, k = (8, 64, 96, 48, 2) if fmt == "int8" else (4, 64, 96, 48, 2)
    x = torch.randn(T, D, generator=g)
    w13, s13 = quantize(torch.randn(E, 2 * inter, D, generator=g) * 0.1)
    w2, s2 = quantize(torch.randn(E, D, inter, generator=g) * 0.1)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    y = ops.moe_experts_native(x, weights, ids, w13, w2, s13, s2)
    ref = moe_experts_ref(x.double(), weights.double(), ids, dequantize(w13, s13, torch.float64),
                          dequantize(w2, s2, torch.float64))
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    if fmt == "int8":  # the row-split path (blocked_from past every count): the same products
        rows = ops.moe_experts_native(x, weights, ids, w13, w2, s13, s2, blocked_from=T + 1)
        torch.testing.assert_close(y, rows, atol=1e-5, rtol=1e-5)

@pytest.mark.parametrize(("M", "N", "K"), [(1, 1, 32), (5, 17, 64), (33, 64, 96),
                                           (300, 40, 128)])
def test_amx_product_on_mxfp4_weights_is_exact_bf16_panels(M: int, N: int, K: int) -> None:
    """MXFP4 weights decoded to bf16 panels on the way (exact: two significant bits times a
    power of two), the fp32-class bound against float64 on the decoded weights, over the
    team and on one thread (an expert block's product) alike."""
    from kdaserve.kernels.ref.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    g = gen(M * N + K + 2)
    x = torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 4
    codes, scales = quantize_mxfp4(torch.randn(N, K, generator=g))
    deq = dequantize_mxfp4(codes, scales, torch.float64)

    def product(team: int) -> torch.Tensor:
        y = torch.empty(M, N)
        rc = ops.library().linear_amx_mxfp4w(x.data_ptr(), codes.data_ptr(), scales.data_ptr(),
                                             y.data_ptr(), M, N, K, team)
        assert rc == 0
        return y

    err = (product(1).double() - x.double() @ deq.t()).abs()
    b = (2.0**-16 + K * 2.0**-23) * (x.double().abs() @ deq.abs().t())
    assert bool((err <= b).all()), float((err / b).max())
    assert torch.equal(product(0), product(1))

