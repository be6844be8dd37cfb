"""The native skinny GEMMs (`linear_native`, csrc/gemm_cpu.cpp) against torch: every row
count around the dot and broadcast tiles, every size of last panel, fp32 / bf16 / int8
weights; and which rows go to the native kernel, oneDNN or sgemm on each host."""

from __future__ import annotations

import pytest
import torch

from kdaserve.kernels.native.ops import linear_native

from .conftest import bound, spy_on_native_calls


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 24, 25, 32, 33, 48,
                                  64, 97])
@pytest.mark.parametrize("K", [16, 40, 43, 768])
def test_linear_native_matches_torch(rows: int, K: int, monkeypatch) -> None:
    """Row counts around the streamed rows (1-8 on AVX2, 1-3 on AVX-512), the narrow tiles
    (fp32 at 5-8 rows on AVX2, 4-24 on AVX-512 in one, two or three 8-lane vectors; bf16 and
    int8 take the dot tiles there), the broadcast tiles' whole and padded vectors of x rows (8
    lanes on AVX2, 16 on AVX-512) and x^T's column blocks (16 rows on AVX2, the last one
    narrower at 33 and 97; 48 on AVX-512, narrower at 97); K not a multiple of 16, and of 8
    (x^T's fill past its 8 x 8 transposes); 70 output columns, not a multiple of the tiles'
    weight rows. The native kernel at every count (oneDNN or sgemm would take fp32 above
    linear_native_max_rows)."""
    from kdaserve.kernels.native import ops

    monkeypatch.setattr(ops, "linear_native_max_rows", lambda weight: 128)
    g = gen(rows * K)
    x, w = torch.randn(2, rows, K, generator=g), torch.randn(70, K, generator=g)
    torch.testing.assert_close(linear_native(x[1], w), torch.nn.functional.linear(x[1], w),
                               atol=1e-4, rtol=1e-5)
    assert linear_native(x, w).shape == (2, rows, 70)


@pytest.mark.parametrize("N", range(49, 57))
@pytest.mark.parametrize("rows", [6, 9, 20, 33])
def test_linear_native_every_last_panel(N: int, rows: int, monkeypatch) -> None:
    """The broadcast tiles (9+ rows) take weight rows in panels of 6 (AVX2) or 8 (AVX-512),
    the narrow tiles (6 rows; 20 on AVX-512) in tiles of 8; eight consecutive output counts
    leave every size of last panel or tile, which runs as one of that many rows."""
    from kdaserve.kernels.native import ops

    monkeypatch.setattr(ops, "onednn_native_max_rows", lambda elements, K: 64)
    g = gen(N * rows)
    x, w = torch.randn(rows, 40, generator=g), torch.randn(N, 40, generator=g)
    torch.testing.assert_close(linear_native(x, w), torch.nn.functional.linear(x, w),
                               atol=1e-4, rtol=1e-5)


def test_linear_native_takes_more_rows_of_a_large_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    """An lm_head-sized weight stays on the native GEMM up to LARGE_WEIGHT_MAX_ROWS rows."""
    from kdaserve.kernels.native import ops

    monkeypatch.setattr(ops, "LARGE_WEIGHT", 70 * 40)  # this test's weight counts as large
    monkeypatch.setattr(ops, "onednn_usable", lambda: False)  # sgemm's caps
    g = gen(5)
    w = torch.randn(70, 40, generator=g)
    calls = spy_on_native_calls(monkeypatch)
    for rows, native in ((64, True), (ops.LARGE_WEIGHT_MAX_ROWS + 1, False)):
        calls.clear()
        x = torch.randn(rows, 40, generator=g)
        torch.testing.assert_close(ops.linear_native(x, w), torch.nn.functional.linear(x, w),
                                   atol=1e-4, rtol=1e-5)
        assert (calls == ["linear_small_f32"]) == native


def test_gemm_row_padding_keeps_few_shapes() -> None:
    """Products run at padded row counts (so oneDNN compiles few kernels): never fewer rows,
    at most 1.5x as many below 128 rows and 1.25x above, ~60 distinct counts up to 4,096."""
    from kdaserve.kernels.cpu.gemm import padded_rows

    counts = [padded_rows(m) for m in range(1, 4097)]
    assert all(p >= m for m, p in zip(range(1, 4097), counts, strict=True))
    assert all(p == m for m, p in zip(range(1, 17), counts, strict=False))
    assert all(p <= 1.5 * m for m, p in zip(range(17, 129), counts[16:128], strict=True))
    assert all(p <= 1.25 * m for m, p in zip(range(129, 4097), counts[128:], strict=True))
    assert len(set(counts)) <= 60


def test_fp32_products_above_a_few_rows_go_to_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    """With oneDNN, fp32 weights use the native GEMM only up to onednn_native_max_rows rows;
    bf16 weights keep it up to QUANTIZED_MAX_ROWS (oneDNN would need them widened first), or
    at every row count where AMX runs them. Every result equals F.linear on the fp32
    values."""
    from kdaserve.kernels.cpu.gemm import gemm, onednn_usable
    from kdaserve.kernels.native import ops

    assert onednn_usable()  # torch's CPU build here has oneDNN
    calls = spy_on_native_calls(monkeypatch)
    g = gen(9)
    w = torch.randn(70, 40, generator=g)
    cap = ops.onednn_native_max_rows(w.numel(), w.shape[1])
    for rows, weight, native in ((cap, w, True), (cap + 1, w, False),
                                 (300, w, False), (9, w.bfloat16(), True),
                                 (ops.QUANTIZED_MAX_ROWS, w.bfloat16(), True),
                                 (ops.QUANTIZED_MAX_ROWS + 1, w.bfloat16(), ops.amx())):
        calls.clear()
        x = torch.randn(1, rows, 40, generator=g)
        want = torch.nn.functional.linear(x, weight.float())
        torch.testing.assert_close(ops.linear_native(x, weight), want, atol=1e-4, rtol=1e-5)
        assert bool(calls) == native, (rows, weight.dtype, calls)
    x = torch.randn(3, 7, 40, generator=g)
    torch.testing.assert_close(gemm(x, w), torch.nn.functional.linear(x, w), atol=1e-4,
                               rtol=1e-5)


def test_fp32_gemm_takes_sgemm_on_intel_below_lm_head_size(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 products past the native caps: MKL's sgemm on Intel (F.linear itself, bit for
    bit) unless the weight is lm_head-sized (MKL repacks it every call), oneDNN elsewhere;
    the same values either way."""
    from kdaserve.kernels.cpu import gemm as cpu_gemm

    real = cpu_gemm.onednn_linear
    onednn: list[tuple[int, ...]] = []
    monkeypatch.setattr(cpu_gemm, "onednn_linear",
                        lambda x, w: onednn.append(tuple(w.shape)) or real(x, w))
    g = gen(11)
    w, x = torch.randn(70, 40, generator=g), torch.randn(2, 33, 40, generator=g)
    want = torch.nn.functional.linear(x, w)
    for vendor, max_weight, sgemm in (("GenuineIntel", 2**20, True),
                                      ("GenuineIntel", 70 * 40, False),
                                      ("AuthenticAMD", 2**20, False), ("", 2**20, False)):
        monkeypatch.setattr(cpu_gemm, "cpu_vendor", lambda vendor=vendor: vendor)
        monkeypatch.setattr(cpu_gemm, "SGEMM_MAX_WEIGHT", max_weight)
        cpu_gemm.mkl_on_intel.cache_clear()
        onednn.clear()
        y = cpu_gemm.gemm(x, w)
        assert onednn == ([] if sgemm else [(70, 40)]), vendor
        if sgemm:
            assert torch.equal(y, want)
        torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-5)
    monkeypatch.undo()
    cpu_gemm.mkl_on_intel.cache_clear()  # the host's own answer again


def test_native_caps_follow_the_instruction_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN's AVX-512 code wins from 65 rows on AMD (49 for inputs wider than 1,024), from
    17 on Intel (9 for a large weight); its AVX2 code only above 96 (64 for inputs wider than
    512 or a large weight). The native MoE kernel runs an expert's tokens as blocks from 16 of
    them on AVX-512, from 8 elsewhere."""
    from kdaserve.kernels.native import isa, ops

    large, wide = ops.LARGE_WEIGHT, ops.WIDE_INPUT
    for level, vendor, elements, K, cap in (
            ("avx512", "AuthenticAMD", 2**16, 256, 64),
            ("avx512_bf16", "AuthenticAMD", large, 768, 64),
            ("avx512", "AuthenticAMD", 2**20, 2048, 48),
            ("avx512", "GenuineIntel", 2**16, 256, 16), ("amx", "GenuineIntel", large, 768, 8),
            ("avx2", "GenuineIntel", 2**16, 256, 96), ("avx2", "AuthenticAMD", 2**20, wide, 96),
            ("avx2", "", 2**20, wide + 1, 64), ("avx2", "", large, 256, 64),
            (None, "", 2**20, 256, 96)):
        monkeypatch.setattr(isa, "level", lambda level=level: level)
        monkeypatch.setattr(ops, "cpu_vendor", lambda vendor=vendor: vendor)
        ops.avx512.cache_clear()
        assert ops.onednn_native_max_rows(elements, K) == cap
        assert ops.moe_blocked_from() == (8 if level in ("avx2", None) else 16)
    monkeypatch.undo()
    ops.avx512.cache_clear()  # the host's own answer again
    assert ops.cpu_vendor() in ("GenuineIntel", "AuthenticAMD", "")  # this host's


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 24, 33, 64])
@pytest.mark.parametrize("K", [40, 77, 768, 1100])
def test_linear_native_with_bf16_weights(rows: int, K: int) -> None:
    """Weight-only bf16: fp32 activations against bf16 weights, widened in registers (the
    streamed rows: 1-3 on AVX-512, 1-8 on AVX2, each row count its own number of partial sums)
    or per block (more rows; at 6-24 on AVX-512, 16-24 for inputs wider than 1,024, each
    weight broadcast from its two bytes in the narrow tiles); equal to fp32 arithmetic on the
    same (bf16) values. From
    16 rows on an AMX host the tiles take them, and 1-4 rows on an AVX512_BF16 host the BF16
    dots, both on split activations (within test_native_amx's bound)."""
    from kdaserve.kernels.native import ops

    g = gen(rows + K)
    x = torch.randn(rows, K, generator=g)
    w = torch.randn(130, K, generator=g).bfloat16()
    y = linear_native(x, w)
    assert y.dtype == torch.float32
    if ops.bf16_split_rows(rows):
        err = (y.double() - x.double() @ w.double().t()).abs()
        assert bool((err <= bound(x, w)).all())
    else:
        torch.testing.assert_close(y, torch.nn.functional.linear(x, w.float()), atol=1e-4,
                                   rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 33, 64])
@pytest.mark.parametrize("K", [72, 77, 200])
def test_linear_native_with_int8_weights(rows: int, K: int) -> None:
    """Weight-only int8: the native kernel equals fp32 arithmetic on the dequantized weight.
    K: one 64-weight step of a single row's eight sums and a vector over, a scalar tail, and
    several steps. From 16 rows on an AMX host the tiles take them (within test_native_amx's
    bound, on the dequantized weight)."""
    from kdaserve.kernels import linear_ref
    from kdaserve.kernels.native import ops
    from kdaserve.kernels.ref.quant import dequantize, quantize_int8

    g = gen(rows + K)
    x = torch.randn(rows, K, generator=g)
    q, scale = quantize_int8(torch.randn(130, K, generator=g))
    assert q.dtype == torch.int8 and scale.shape == (130,)
    w = dequantize(q, scale, torch.float32)
    want = torch.nn.functional.linear(x, w)
    y = linear_native(x, q, scale)
    if ops.amx() and rows >= ops.AMX_FROM:
        err = (y.double() - x.double() @ w.double().t()).abs()
        assert bool((err <= bound(x, w)).all())
    else:
        torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(linear_ref(x, q, scale), want, atol=1e-5, rtol=1e-6)
