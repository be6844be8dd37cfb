"""MXFP4 (OCP microscaling FP4), the format Kimi K3's routed experts ship in
(compressed-tensors `mxfp4-pack-quantized`, k3_spec.md 5.2): FP4 E2M1 values, two to a byte
along the input dimension (the low nibble is the even element), and one E8M0 scale (a biased
power of two, 2^(s - 127)) per 32 input elements; no global scale.

A weight [..., N, K] is held as `packed` uint8 [..., N, K / 2] and `scales` uint8
[..., N, K / 32]: 0.53 bytes a parameter. The uint8 dtype is what tells every kernel the
weight is MXFP4 (int8 weights are per-row int8, float weights are themselves)."""

from __future__ import annotations

import torch

GROUP = 32  # input elements per E8M0 scale (config.json's group_size, hub_schema.MXFP4_GROUP)
# E2M1 codes 0..15: bit 3 the sign, bits 0-2 the magnitude {0, 0.5, 1, 1.5, 2, 3, 4, 6};
# code 8 is negative zero
_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
E2M1 = torch.tensor(_MAGNITUDES + [-m for m in _MAGNITUDES], dtype=torch.float32)
# |x| at which rounding moves to the next magnitude (midpoints between neighbours)
_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def mxfp4_shapes(n: int, k: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(packed, scales) shapes of a [n, k] weight; k must be a multiple of the group."""
    if k % GROUP:
        raise ValueError(f"an MXFP4 weight's input dimension must be a multiple of {GROUP}, "
                         f"got {k}")
    return (n, k // 2), (n, k // GROUP)


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """2^(s - 127) in fp32, exact at every code: 0 is 2^-127 (a subnormal), 255 is 2^128
    (infinity in fp32, as in compressed-tensors' decompression)."""
    return torch.ldexp(torch.ones(scales.shape), scales.to(torch.int32) - 127)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed uint8 [..., N, K / 2], scales uint8 [..., N, K / 32] -> [..., N, K] in `dtype`.
    Each value is code x scale computed exactly in fp32, then cast."""
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2).long()
    values = E2M1.to(packed.device)[codes]  # [..., N, K]
    *lead, K = values.shape
    grouped = values.view(*lead, K // GROUP, GROUP) * e8m0_to_float(scales).to(
        packed.device).unsqueeze(-1)
    return grouped.view(*lead, K).to(dtype)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] float -> (packed, scales), as the OCP MX spec quantizes: each
    group's scale 2^(floor(log2(amax)) - 2) (E2M1's largest exponent is 2), each value
    rounded to the nearest E2M1 magnitude (ties to the even code), saturating at 6."""
    w = weight.float()
    *lead, K = w.shape
    mxfp4_shapes(1, K)
    groups = w.reshape(*lead, K // GROUP, GROUP)
    amax = groups.abs().amax(-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127))
    exp = exp.clamp(-127, 127)
    scaled = groups / torch.ldexp(torch.ones_like(exp), exp.int()).unsqueeze(-1)
    a = scaled.abs().clamp(max=6.0)
    lower = torch.bucketize(a, _MIDPOINTS, right=False)  # a tie rounds down here...
    upper = torch.bucketize(a, _MIDPOINTS, right=True)  # ...and up here
    mag = torch.where((lower != upper) & (lower % 2 == 1), upper, lower)
    codes = (mag | (scaled < 0).long() << 3).to(torch.uint8).reshape(*lead, K)
    packed = codes[..., 0::2] | codes[..., 1::2] << 4
    return packed.contiguous(), (exp + 127).to(torch.uint8)
