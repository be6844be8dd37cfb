"""Weight-only int8: each output row of a weight scaled by its largest magnitude over 127
(symmetric, per channel), as llama.cpp's q8_0 but per row rather than per 32-block. And the
one way every kernel's reference widens a stored weight (`dequantize`), whatever its format:
float, int8 with row scales, or MXFP4 (uint8, `mxfp4.py`)."""

from __future__ import annotations

import torch

from kdaserve.kernels.ref.mxfp4 import dequantize_mxfp4


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] float -> (int8 [..., N, K], fp32 scale [..., N])."""
    w = weight.float()
    scale = w.abs().amax(-1).clamp(min=1e-30) / 127
    q = torch.round(w / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor | None,
               dtype: torch.dtype) -> torch.Tensor:
    """A weight as `dtype` values: int8 times its row scales, MXFP4 (uint8 packed codes) times
    its group scales, or a float weight cast."""
    if weight.dtype == torch.uint8:
        if scale is None:
            raise ValueError("MXFP4 weights come with their E8M0 scales")
        return dequantize_mxfp4(weight, scale, dtype)
    w = weight.to(dtype)
    return w if scale is None else w * scale.to(dtype).unsqueeze(-1)
