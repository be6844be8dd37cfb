"""Decode-specialised ops: every sequence of the batch has exactly one new token.

Same contracts as kernels/ref (the oracle they are tested against); other shapes go to ref
(MLA's to the prefill path in kernels/cpu/mla.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kdaserve.kernels.cpu.mla import mla_prefill_cpu
from kdaserve.kernels.ref.kda import (
    compose_kda_decode,
    kda_gate_ref,
    kda_recurrent_ref,
    l2norm_ref,
    short_conv_ref,
)


def _all_decode(cu_seqlens: torch.Tensor, num_tokens: int) -> bool:
    return cu_seqlens.shape[0] - 1 == num_tokens


def kda_recurrent_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                      state: torch.Tensor, state_slots: torch.Tensor,
                      cu_seqlens: torch.Tensor, lower_bound: float | None = None,
                      ) -> torch.Tensor:
    """One delta-rule step for B sequences as batched matmuls over [B, H, K, V] states."""
    if not _all_decode(cu_seqlens, q.shape[0]):
        return kda_recurrent_ref(q, k, v, g, beta, A_log, dt_bias, state, state_slots, cu_seqlens,
                                 lower_bound)
    qn, kn = l2norm_ref(q), l2norm_ref(k)  # [B, H, K]
    decay = kda_gate_ref(g, A_log, dt_bias, lower_bound).exp()  # [B, H, K]
    b = torch.sigmoid(beta.float()).unsqueeze(-1)  # [B, H, 1]
    S = state.index_select(0, state_slots).float() * decay.unsqueeze(-1)  # [B, H, K, V]
    pred = (kn.unsqueeze(-2) @ S).squeeze(-2)  # k^T S: [B, H, V]
    delta = (v.float() - pred) * b
    S = S + kn.unsqueeze(-1) * delta.unsqueeze(-2)
    o = (qn.unsqueeze(-2) * q.shape[-1] ** -0.5 @ S).squeeze(-2)
    state.index_copy_(0, state_slots, S.to(state.dtype))
    return o.to(v.dtype)


def kda_decode_cpu(qkv: torch.Tensor, f: torch.Tensor, beta: torch.Tensor, z: torch.Tensor,
                   conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                   norm_weight: torch.Tensor, eps: float, state: torch.Tensor,
                   conv_state: torch.Tensor, state_slots: torch.Tensor,
                   cu_seqlens: torch.Tensor | None = None,
                   lower_bound: float | None = None) -> torch.Tensor:
    """`kda_decode_ref`'s composition with the batched decode ops above."""
    return compose_kda_decode(short_conv_cpu, kda_recurrent_cpu, qkv, f, beta, z, conv_weight,
                              A_log, dt_bias, norm_weight, eps, state, conv_state, state_slots,
                              cu_seqlens, lower_bound=lower_bound)


def short_conv_cpu(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                   state_slots: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Decode: window = [cached W-1 inputs, current] per sequence, one weighted sum."""
    if not _all_decode(cu_seqlens, x.shape[0]):
        return short_conv_ref(x, weight, conv_state, state_slots, cu_seqlens)
    window = torch.cat([conv_state.index_select(0, state_slots).to(x.dtype), x.unsqueeze(1)],
                       dim=1)  # [B, W, D]
    y = (window.float() * weight.float().t().unsqueeze(0)).sum(1)
    conv_state.index_copy_(0, state_slots, window[:, 1:].to(conv_state.dtype))
    return F.silu(y).to(x.dtype)


def mla_attention_cpu(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                      block_table: torch.Tensor, cu_seqlens: torch.Tensor,
                      context_lens: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                      scale: float, max_seqlen: int = 0) -> torch.Tensor:
    """Decode against the paged latent cache for the whole batch at once: latents gathered
    through the block table into [B, L, R + Dr] (L = longest context), padded keys masked.
    Other batches go to the prefill path, which picks a form per sequence."""
    if not _all_decode(cu_seqlens, q_nope.shape[0]):
        return mla_prefill_cpu(q_nope, q_pe, kv_cache, block_table, cu_seqlens,
                               context_lens, w_uk, w_uv, scale)
    B = q_nope.shape[0]
    bs, D = kv_cache.shape[1], kv_cache.shape[2]
    R = w_uk.shape[-1]
    L = int(context_lens.max())
    pos = torch.arange(L, device=q_nope.device)
    rows = block_table[:, : -(-L // bs)].gather(1, (pos // bs).expand(B, L)) * bs + pos % bs
    lat = kv_cache.view(-1, D)[rows].float()  # [B, L, D]
    latent, k_pe = lat[..., :R], lat[..., R:]
    q_lat = torch.einsum("bhd,hdr->bhr", q_nope.float(), w_uk.float())  # [B, H, R]
    scores = (q_lat @ latent.transpose(1, 2) + q_pe.float() @ k_pe.transpose(1, 2)) * scale
    scores = scores.masked_fill((pos >= context_lens.unsqueeze(1)).unsqueeze(1), float("-inf"))
    o_lat = scores.softmax(-1) @ latent  # [B, H, R]
    return torch.einsum("bhr,hvr->bhv", o_lat, w_uv.float()).to(q_nope.dtype)
