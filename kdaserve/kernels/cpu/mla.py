"""MLA prefill on a CPU: per sequence, the cheaper of two exact forms by their FLOP counts.

Same contract as `mla_attention_ref` (the oracle it is tested against). The absorbed form
(the reference's, and decode's) scores every new query against every cached latent in R + Dr
dimensions and sums R-wide latents per query and head. For a long chunk it pays to expand the
latents instead, once per sequence (k_nope and v = the latents through kv_b_proj, one GEMM):
the attention then runs in Dn + Dr and Dv dimensions, with the causal half skipped, in torch's
flash kernel (the reference's einsums build the whole n x c score matrix and mask half of it).
The expansion costs c * R * H * (Dn + Dv) multiply-adds whatever n is, so a short chunk after a
long context stays absorbed: at the `bench` shapes 64 tokens after 1,000 cost 2x in the flash
form, 256 after 1,024 tie, and a 2,048-token prompt runs 4x faster.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kdaserve.kernels.ref.mla import gather_latent, mla_attention_ref


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [H, n, E] over k, v [H, L, E] with the log-sum-exp of its scores
    [H, n] (to merge with another block's). Torch's CPU flash kernel: SDPA itself returns no
    log-sum-exp, and with a boolean mask it runs ~10x slower than unmasked or top-left
    causal."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), 0.0, causal, attn_mask=None,
        scale=scale)
    return out[0], lse[0]


def flash_pays(n: int, c: int, H: int, Dn: int, Dr: int, Dv: int, R: int) -> bool:
    """Whether the expanded (flash) form of n new tokens after c - n cached ones costs fewer
    multiply-adds than the absorbed form (each query absorbed through W_UK and W_UV, scored
    and summed over all c latents, masked entries included, as the reference computes)."""
    absorbed = n * H * (2 * Dn * R + c * (2 * R + Dr))
    width = max(Dn + Dr, Dv)  # the flash kernel runs q, k and v padded to one width
    expanded = c * R * H * (Dn + Dv) + n * H * (c - n / 2) * 2 * width
    return expanded < absorbed


def mla_prefill_flash(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                      block_table: torch.Tensor, context_len: int, w_kvb: torch.Tensor,
                      Dn: int, scale: float) -> torch.Tensor:
    """One sequence's n new tokens (the last n of its context_len cached latents) in the
    expanded form: the first c - n latents are seen by every query (one unmasked block), the
    last n causally (a top-left causal block), the two merged by their log-sum-exps.
    w_kvb: [H, Dn + Dv, R] fp32 (W_UK and W_UV per head). Returns [n, H, Dv] fp32."""
    n, c = q_nope.shape[0], context_len
    H, R = w_kvb.shape[0], w_kvb.shape[2]
    Dv, E = w_kvb.shape[1] - Dn, Dn + q_pe.shape[-1]
    W = max(E, Dv)
    lat = gather_latent(kv_cache, block_table, c).float()
    kv = F.linear(lat[:, :R], w_kvb.reshape(-1, R)).view(c, H, Dn + Dv)
    # keys [H, c, Dn + Dr] (the rope part shared by the heads); queries, keys and values
    # zero-padded to one width, which the flash kernel wants (zeros add nothing to a score,
    # the scale is given, and the padding's outputs are dropped)
    k = torch.cat([kv[..., :Dn], lat[:, R:].unsqueeze(1).expand(c, H, E - Dn)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1).float()
    q = F.pad(q, (0, W - E)).transpose(0, 1)
    k = F.pad(k, (0, W - E)).transpose(0, 1)
    v = F.pad(kv[..., Dn:], (0, W - Dv)).transpose(0, 1)
    o, lse = _flash(q, k[:, c - n:], v[:, c - n:], True, scale)
    if c > n:  # cached context before the chunk: every query sees all of it
        o_ctx, lse_ctx = _flash(q, k[:, : c - n], v[:, : c - n], False, scale)
        m = torch.maximum(lse, lse_ctx)
        a, b = (lse - m).exp().unsqueeze(-1), (lse_ctx - m).exp().unsqueeze(-1)
        o = (o * a + o_ctx * b) / (a + b)
    return o[..., :Dv].transpose(0, 1)


def mla_prefill_cpu(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                    block_table: torch.Tensor, cu_seqlens: torch.Tensor,
                    context_lens: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """`mla_attention_ref`'s contract; each sequence in the form `flash_pays` picks."""
    cu, ctx = cu_seqlens.tolist(), context_lens.tolist()
    H, Dn, R = w_uk.shape
    Dr, Dv = q_pe.shape[-1], w_uv.shape[1]
    w_kvb: torch.Tensor | None = None
    out = q_nope.new_empty(q_nope.shape[0], H, Dv)
    for b in range(len(cu) - 1):
        s, e, c = cu[b], cu[b + 1], ctx[b]
        if s == e:
            continue
        if flash_pays(e - s, c, H, Dn, Dr, Dv, R):
            if w_kvb is None:
                w_kvb = torch.cat([w_uk, w_uv], dim=1).float()
            o = mla_prefill_flash(q_nope[s:e], q_pe[s:e], kv_cache, block_table[b], c, w_kvb,
                                  Dn, scale)
        else:
            o = mla_attention_ref(q_nope[s:e], q_pe[s:e], kv_cache, block_table[b:b + 1],
                                  cu_seqlens.new_tensor([0, e - s]), context_lens[b:b + 1],
                                  w_uk, w_uv, scale)
        out[s:e] = o.to(out.dtype)
    return out
