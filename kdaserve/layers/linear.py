"""A bias-free projection whose matmul is the `linear` kernel op, chosen once at model build
(decode-sized inputs take the native kernel, which streams weights faster than sgemm)."""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.kernels import Kernels


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, kernels: Kernels) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        # weight-only int8: the weight holds int8 values and this their per-row fp32 scales
        self.scale: torch.Tensor | None = None
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(x, self.weight, self.scale)
