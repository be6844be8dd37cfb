"""RMSNorm variants as Kimi Linear uses them."""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.kernels import Kernels, rms_norm_ref


class RMSNorm(nn.Module):
    """T5-style: normalise in fp32, cast back, then multiply by the weight (KimiRMSNorm).
    Without `kernels` (a drafter's norm) it runs the reference op."""

    def __init__(self, dim: int, eps: float, kernels: Kernels | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.op = rms_norm_ref if kernels is None else kernels.rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.weight, self.eps)
