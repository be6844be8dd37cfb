"""Plain-torch MoE reference: routing (sigmoid/softmax, grouped top-k) and an expert loop."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kdaserve.kernels.ref.mlp import situ_mul_ref
from kdaserve.kernels.ref.quant import dequantize


def _row(scale: torch.Tensor | None, e: int) -> torch.Tensor | None:
    return None if scale is None else scale[e]


def _sum_last(t: torch.Tensor) -> torch.Tensor:
    return t.sum(-1)


def moe_route_ref(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                  num_group: int, topk_group: int, renormalize: bool, scaling: float,
                  activation: str, *, sigmoid: Callable = torch.sigmoid,
                  sum_last: Callable = _sum_last) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 "noaux_tc" routing.  logits: [T, E] fp32 -> (weights [T, k], ids [T, k]).

    The correction bias steers *selection* only; the weights are the unbiased scores (as in
    vLLM, SGLang and transformers). `sigmoid` and `sum_last` are the only arithmetic that is
    not exact selection: the batch-invariant backend passes its own.
    """
    T, E = logits.shape
    scores = sigmoid(logits) if activation == "sigmoid" else logits.softmax(-1)
    choice = scores + bias if bias is not None else scores
    if num_group > 1:
        grouped = choice.view(T, num_group, E // num_group)
        group_score = sum_last(grouped.topk(min(2, E // num_group), dim=-1).values)
        keep = group_score.topk(topk_group, dim=-1).indices
        mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(E // num_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (sum_last(weights).unsqueeze(-1) + 1e-20)
    return weights * scaling, ids


def moe_experts_ref(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    w13: torch.Tensor, w2: torch.Tensor, scale13: torch.Tensor | None = None,
                    scale2: torch.Tensor | None = None,
                    situ: tuple[float, float | None] | None = None) -> torch.Tensor:
    """sum_k weights[t, k] * E_{ids[t, k]}(x_t), E_e(x) = W2 (SiLU(W1 x) * W3 x).

    x: [T, D]; w13: [E, 2I, D] (gate rows then up rows); w2: [E, D, I].
    `situ = (beta, linear_beta)`: K3's experts, SiTU-GLU instead of SwiGLU and the weighted
    sum accumulated in fp32 (as Moonshot's reference does).
    """
    out = torch.zeros(x.shape, dtype=torch.float32 if situ else x.dtype, device=x.device)
    inter = w13.shape[1] // 2
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        h = F.linear(x[tok], dequantize(w13[e], _row(scale13, e), x.dtype))
        h = situ_mul_ref(h, *situ) if situ else F.silu(h[:, :inter]) * h[:, inter:]
        y = F.linear(h, dequantize(w2[e], _row(scale2, e), x.dtype))
        y = y.to(out.dtype) * weights[tok, slot].unsqueeze(-1).to(out.dtype)
        out.index_add_(0, tok, y)
    return out.to(x.dtype)
