"""MXFP4 (kernels/ref/mxfp4.py) against compressed-tensors 0.20.0, the library K3's experts
were written with: its decompression of the same packed tensors, bit for bit, at every code
(negative zero included) and every scale (the smallest, the largest, the ones that overflow);
and the quantizer's rounding (nearest E2M1 magnitude, ties to the even code)."""

from __future__ import annotations

import pytest
import torch

from kdaserve.kernels.ref.mxfp4 import E2M1, GROUP, dequantize_mxfp4, quantize_mxfp4
from kdaserve.kernels.ref.quant import dequantize

ct = pytest.importorskip("compressed_tensors.compressors.mxfp4.base")
quant = pytest.importorskip("compressed_tensors.quantization")


def theirs(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' decompression of one MXFP4 weight (it returns bf16)."""
    args = quant.QuantizationArgs(num_bits=4, type="float", strategy="group", group_size=32,
                                  symmetric=True, dynamic=False, scale_dtype=torch.uint8)
    scheme = quant.QuantizationScheme(targets=["Linear"], weights=args)
    out = ct.MXFP4PackedCompressor.decompress(
        {"weight_packed": packed, "weight_scale": scales}, scheme)
    return out["weight"]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_every_code_and_every_scale_equal_compressed_tensors() -> None:
    # 256 rows: row r's single group has scale r; its 16 bytes hold every code pair once
    # (low nibble i, high nibble 15 - i), so every (code, scale) combination appears
    codes = torch.arange(16, dtype=torch.uint8)
    row = codes | (15 - codes) << 4
    packed = row.repeat(256, 1)  # [256, 16]: 32 values per row
    scales = torch.arange(256, dtype=torch.uint8).view(256, 1)
    ours = dequantize_mxfp4(packed, scales, torch.float32)
    ref = theirs(packed, scales)
    assert ref.dtype == torch.bfloat16
    # our fp32 values are exact; in bf16 they are theirs, bit for bit (NaN where 0 meets
    # the infinite scale 255 in both, so compared as bits)
    assert same_bits(ours.to(torch.bfloat16), ref)
    assert same_bits(dequantize_mxfp4(packed, scales, torch.bfloat16), ref)
    assert torch.signbit(ours[127, 16]) and ours[127, 16] == 0  # code 8: negative zero
    # the low nibble is the even element
    assert ours[127, 0] == E2M1[0] and ours[127, 1] == E2M1[15] and ours[127, 2] == E2M1[1]
    assert ours[0, 2] == 2.0 ** -128 and torch.isinf(ours[255, 2])  # 0.5 x 2^-127, 0.5 x 2^128


def test_random_weights_equal_compressed_tensors_through_dequantize() -> None:
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 24, 48), generator=g, dtype=torch.uint8)  # K = 96
    scales = torch.randint(100, 140, (3, 24, 3), generator=g, dtype=torch.uint8)
    ours = dequantize(packed, scales, torch.float32)  # the kernels' one widening
    for e in range(3):
        assert same_bits(ours[e].to(torch.bfloat16), theirs(packed[e], scales[e]))
    with pytest.raises(ValueError, match="scales"):
        dequantize(packed, None, torch.float32)


def test_quantize_rounds_to_the_nearest_code_ties_to_even() -> None:
    # one group with amax 6 (scale 2^0): the values sit on and between the E2M1 magnitudes
    vals = [0.0, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, 6.0, -0.75, -5.0, 0.5, 1.0]
    w = torch.tensor(vals + [0.0] * (GROUP - len(vals)))
    w[-1] = 6.0  # amax 6: scale 2^(floor(log2 6) - 2) = 1
    packed, scales = quantize_mxfp4(w.view(1, GROUP))
    assert scales.item() == 127
    got = dequantize_mxfp4(packed, scales)[0, :len(vals)].tolist()
    # ties: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    assert got == [0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -1.0, -4.0, 0.5,
                   1.0]


def test_quantize_round_trip_error() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 4 * GROUP, generator=g) * torch.logspace(-3, 3, 8).view(8, 1)
    packed, scales = quantize_mxfp4(w)
    assert packed.shape == (8, 2 * GROUP) and scales.shape == (8, 4)
    back = dequantize_mxfp4(packed, scales)
    # within 2 x scale: the OCP scale lets |x| / scale reach 8, saturated at 6 (elsewhere
    # half a step, at most 1 x scale); and exact where the value is a code times the scale
    scale = torch.ldexp(torch.ones(8, 4), scales.int() - 127).repeat_interleave(GROUP, 1)
    assert ((back - w).abs() <= 2 * scale).all()
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(back)), back)
    zero_packed, zero_scales = quantize_mxfp4(torch.zeros(1, GROUP))
    assert zero_scales.item() == 0 and not zero_packed.any()


@pytest.mark.parametrize("widths", [(96, 160), (128, 192)], ids=["odd-groups", "group-pairs"])
@pytest.mark.parametrize("situ", [None, (4.0, 25.0)], ids=["swiglu", "situ"])
@pytest.mark.parametrize("tokens", [1, 3, 5, 40, 200])
def test_native_experts_are_the_reference(tokens: int, situ: tuple | None,
                                          widths: tuple[int, int]) -> None:
    """The native MXFP4 experts (csrc/mxfp4_cpu.cpp) against dequantize-then-matmul: streamed
    (an expert with up to 15 tokens, four at a time) and as token blocks on the broadcast
    tiles (16 or more: 40 tokens mixes both, 200 splits experts into several blocks), widths
    of 3 and 5 groups (D 96, I 160: row blocks and panels with tails), and of whole pairs of
    groups (D 128, I 192), which the streamed rows take on the BF16 dots where the build has
    them (x in two bf16 parts), SwiGLU and SiTU. On AMX hosts the token blocks run on the
    tiles, their panels decoded to bf16 (`test_rows_decode_to_bf16_exactly`)."""
    from kdaserve.kernels.native.build import available
    from kdaserve.kernels.native.ops import moe_experts_native
    from kdaserve.kernels.ref.moe import moe_experts_ref

    if not available()[0]:
        pytest.skip(f"no native library: {available()[1]}")
    g = torch.Generator().manual_seed(tokens)
    (D, inter), E, k = widths, 6, 3
    x = torch.randn(tokens, D, generator=g)
    w13, s13 = quantize_mxfp4(torch.randn(E, 2 * inter, D, generator=g))
    w2, s2 = quantize_mxfp4(torch.randn(E, D, inter, generator=g) / inter ** 0.5)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    want = moe_experts_ref(x, weights, ids, w13, w2, s13, s2, situ=situ)
    got = moe_experts_native(x, weights, ids, w13, w2, s13, s2, situ=situ)
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=1e-4)


def test_rows_decode_to_bf16_exactly() -> None:
    """`mxfp4_rows_bf16` (csrc/mxfp4_cpu.cpp), the panels AMX's tiles read MXFP4 experts
    from: rows p..p+tn of every code at every scale, into a row stride wider than K (the
    padding past K untouched), equal to the reference's bf16 decode bit for bit (NaN where a
    zero meets the infinite scale, in both)."""
    from kdaserve.kernels.native.build import available, library
    from kdaserve.kernels.native.tensors import ptr

    if not available()[0]:
        pytest.skip(f"no native library: {available()[1]}")
    codes = torch.arange(16, dtype=torch.uint8)
    pairs = (codes | (15 - codes) << 4).repeat(3)  # 48 bytes: K = 96, three groups a row
    packed = torch.stack([pairs.roll(r) for r in range(256)])  # every code in every group
    scales = torch.stack([torch.tensor([r, 255 - r, (r * 7) % 256]) for r in range(256)])
    scales = scales.to(torch.uint8)
    K, ldo, p, tn = 96, 112, 5, 250
    out = torch.full((tn, ldo), 0x1234, dtype=torch.int16)
    library().mxfp4_rows_bf16(ptr(packed), ptr(scales), p, tn, K, ptr(out), ldo)
    want = dequantize_mxfp4(packed[p:p + tn], scales[p:p + tn], torch.bfloat16)
    got = out[:, :K].view(torch.bfloat16)
    assert torch.equal(got.isnan(), want.isnan()) and want.isnan().any()
    finite = ~want.isnan()
    assert same_bits(got[finite], want[finite])
    assert (out[:, K:] == 0x1234).all()
