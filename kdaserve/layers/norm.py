"""RMSNorm variants as Kimi Linear uses them."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """T5-style: normalise in fp32, cast back, then multiply by the weight (KimiRMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)
