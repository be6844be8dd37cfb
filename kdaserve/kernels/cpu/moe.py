"""MoE experts on CPU: tokens sorted by expert once, one pair of GEMMs per active expert.

The reference finds each expert's tokens with its own comparison and nonzero over all [T, k]
choices, and scatters per expert; here one stable sort groups the choices, one host sync
reads the group sizes, every expert's rows land in one buffer, and one index_add_ combines.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kdaserve.kernels.cpu.gemm import gemm
from kdaserve.kernels.ref.quant import dequantize


def moe_experts_cpu(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    w13: torch.Tensor, w2: torch.Tensor, scale13: torch.Tensor | None = None,
                    scale2: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `moe_experts_ref`."""
    T, k = ids.shape
    inter = w13.shape[1] // 2
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    tok = order // k  # token of each sorted choice
    xs = x.index_select(0, tok)
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        # weight-only bf16 / int8: only the experts this batch touches are widened
        s13, s2 = (None if s is None else s[e] for s in (scale13, scale2))
        h = gemm(xs[start:start + n], dequantize(w13[e], s13, xs.dtype))
        ys[start:start + n] = gemm(F.silu(h[:, :inter]) * h[:, inter:],
                                   dequantize(w2[e], s2, xs.dtype))
        start += n
    ys.mul_(weights.reshape(-1).index_select(0, order).unsqueeze(-1).to(x.dtype))
    return torch.zeros_like(x).index_add_(0, tok, ys)
