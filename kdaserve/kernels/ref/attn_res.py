"""Plain-torch reference of K3's Attention Residuals mix (k3_spec.md 4.2)."""

from __future__ import annotations

import torch

from kdaserve.kernels.ref.norm import rms_norm_ref


def attn_res_mix_ref(bank: torch.Tensor, partial: torch.Tensor, w_eff: torch.Tensor,
                     eps: float) -> torch.Tensor:
    """Softmax mix over the NB bank rows and the current block's partial sum.

    bank: [NB, T, D] (the embeddings, then each finished block's sum); partial: [T, D];
    w_eff: [D] fp32, the site's norm weight times its projection (one learned query).
    Each source j scores <v_j / rms(v_j), w_eff> in fp32; the softmax over the NB + 1 scores
    weighs the un-normalised values. An empty bank returns `partial` itself."""
    if bank.shape[0] == 0:
        return partial
    v = torch.cat([bank, partial.unsqueeze(0)]).float()  # [NB + 1, T, D]
    # per row: an elementwise product and a sum over D (no matmul whose blocking could
    # depend on T), so each token's mix is the same whatever it is batched with
    scores = (v * w_eff.float()).sum(-1) * torch.rsqrt(v.pow(2).mean(-1) + eps)
    p = scores.softmax(0)  # over the sources
    return (p.unsqueeze(-1) * v).sum(0).to(partial.dtype)


def attn_res_norm_ref(bank: torch.Tensor, partial: torch.Tensor, w_eff: torch.Tensor, eps: float,
                      norm_weight: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """The `attn_res_norm` op: the mix, then the RMSNorm that follows every mixing site (the
    layer norms before attention and MLP, the final norm), which a kernel fuses into one pass."""
    return rms_norm_ref(attn_res_mix_ref(bank, partial, w_eff, eps), norm_weight, norm_eps)
