"""Plain-torch MLA reference over the paged latent cache (weight-absorbed form).

The cache holds, per token per MLA layer, the normalised latent `c` (kv_lora_rank) followed by
the shared rope-part key `k_pe`. With NoPE the absorption is exact:
score_h = (W_UK,h^T q_nope,h) . c + q_pe,h . k_pe and o_h = W_UV,h (sum_t p_t c_t).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# new tokens per sequence up to which a sequence attends as decodes do (speculative
# verifies, in a backend's paged decode kernel); longer prefill chunks take its prefill form
VERIFY_MAX_TOKENS = 16


def gather_latent(kv_cache: torch.Tensor, block_table: torch.Tensor, n: int) -> torch.Tensor:
    """First n cached latents of one sequence.  kv_cache: [NB, BS, D]; block_table: [M]."""
    bs = kv_cache.shape[1]
    blocks = block_table[: -(-n // bs)]
    return kv_cache[blocks].reshape(-1, kv_cache.shape[-1])[:n]


def mla_attention_ref(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                      block_table: torch.Tensor, cu_seqlens: torch.Tensor,
                      context_lens: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                      scale: float, max_seqlen: int = 0) -> torch.Tensor:
    """Causal attention of the new tokens against each sequence's cached context.

    q_nope: [T, H, Dn]; q_pe: [T, H, Dr]; kv_cache: [NB, BS, R + Dr] (new tokens already
    stored); block_table: [B, M]; context_lens: [B] tokens in cache incl. the new ones;
    w_uk: [H, Dn, R], w_uv: [H, Dv, R]. Returns [T, H, Dv] in q's dtype; softmax in fp32.
    max_seqlen: the most new tokens of any sequence where the caller knows it (0: not known),
    so a backend that picks its form by it need not read cu_seqlens back (a CUDA graph's
    verify step); the answer never depends on it.
    """
    cu = cu_seqlens.tolist()
    ctx = context_lens.tolist()
    R = w_uk.shape[-1]
    out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])
    for b in range(len(cu) - 1):
        n, c = cu[b + 1] - cu[b], ctx[b]
        lat = gather_latent(kv_cache, block_table[b], c).float()
        latent, k_pe = lat[:, :R], lat[:, R:]
        qn, qp = q_nope[cu[b]:cu[b + 1]].float(), q_pe[cu[b]:cu[b + 1]].float()
        q_lat = torch.einsum("nhd,hdr->nhr", qn, w_uk.float())
        scores = (torch.einsum("nhr,tr->hnt", q_lat, latent)
                  + torch.einsum("nhd,td->hnt", qp, k_pe)) * scale
        # query i sits at absolute position c - n + i and sees cache positions <= that
        pos_q = torch.arange(c - n, c, device=q_nope.device).unsqueeze(1)
        pos_k = torch.arange(c, device=q_nope.device).unsqueeze(0)
        scores = scores.masked_fill(pos_k > pos_q, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        o_lat = torch.einsum("hnt,tr->nhr", p, latent)
        out[cu[b]:cu[b + 1]] = torch.einsum("nhr,hvr->nhv", o_lat, w_uv.float()).to(out.dtype)
    return out


def mla_split_chunks(verifies: Callable, chunks: Callable, q_nope: torch.Tensor,
                     q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     cu_seqlens: torch.Tensor, context_lens: torch.Tensor, w_uk: torch.Tensor,
                     w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """`mla_attention_ref`'s contract for a batch with prefill chunks: its decodes and
    verifies (at most VERIFY_MAX_TOKENS new tokens) in one `verifies` call, its chunks in one
    `chunks` call, each on its rows of q (one chunk must not send a mixed step's every
    decode through a prefill path). Both take that same contract."""
    cu = cu_seqlens.to(torch.int64)
    new = cu[1:] - cu[:-1]
    chunk = new > VERIFY_MAX_TOKENS
    of_chunk = chunk.repeat_interleave(new)  # per token: is it in a chunk's sequence
    out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])
    for seqs, rows, attend in ((~chunk, ~of_chunk, verifies), (chunk, of_chunk, chunks)):
        if not bool(seqs.any()):
            continue
        sub = torch.zeros(int(seqs.sum()) + 1, dtype=torch.int64, device=cu.device)
        torch.cumsum(new[seqs], 0, out=sub[1:])
        out[rows] = attend(q_nope[rows], q_pe[rows], kv_cache, block_table[seqs], sub,
                           context_lens[seqs], w_uk, w_uv, scale)
    return out
