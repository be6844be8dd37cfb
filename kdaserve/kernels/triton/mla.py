"""MLA attention on the paged latent cache in Triton (`mla_attention_ref`'s contract), the
weight-absorbed form, split over the context as flash-decoding does.

Per query token: q_lat = W_UK^T q_nope (a batched matmul in torch), then one program per
(token, block of heads, split of the context) reads the split's latents and rope keys where
they lie in the block pool (through the block table, no gather copy), scores them against
q_lat and q_pe, and keeps an online softmax's unnormalised sum of p * latent with its max and
denominator; the splits are merged by their log-sum-exp in torch, and W_UV maps the merged
latent to the value heads. Causality is each token's own context length: its latent and every
earlier one are in the pool before the call, so a verify's or a prefill chunk's tokens each
see the cache up to their own position. Splits keep the GPU busy when a decode batch is small
and contexts are long (one program per token and head block would leave most SMs idle).
That is the form for decodes and verifies; a prefill chunk (more than VERIFY_MAX_TOKENS new
tokens) takes the expanded form through torch's fused SDPA instead (`mla_prefill_sdpa`).

Triton is imported on the first call (`_kernel`), never at import.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kdaserve.kernels.ref.mla import VERIFY_MAX_TOKENS, gather_latent, mla_split_chunks
from kdaserve.kernels.triton import jit_module, tile

BLOCK_H = 16  # heads per program: tl.dot's least M
# keys per inner step: with 32, at Kimi's 512-wide latents the key tile's addresses spilled
# registers to the stack on sm_90 (255 registers and 240-680 bytes; 214 and none with 16 keys
# and 8 warps; tests/kernels/compiled/check_sm90.py)
BLOCK_N = 16
# splits per token: as many as the table's bound / SPLIT_LEN (no more than the programs
# wanted); each token then cuts its own context into that many equal parts
SPLIT_LEN = 256
# programs worth launching (about two per SM of an H200): splits only add work once the
# tokens and head blocks fill that, so a prefill chunk runs unsplit and its partial sums stay
# [T, 1, H, R] instead of growing with the longest context
TARGET_PROGRAMS = 264


def _kernel() -> Any:
    return jit_module("mla_kernels").mla_split_kernel


def mla_attention_triton(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                         block_table: torch.Tensor, cu_seqlens: torch.Tensor,
                         context_lens: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                         scale: float, max_seqlen: int = 0) -> torch.Tensor:
    """q_nope: [T, H, Dn]; q_pe: [T, H, Dr]; kv_cache: [NB, BS, R + Dr] (new tokens already
    stored); block_table: [B, M]; cu_seqlens: [B+1]; context_lens: [B] incl. the new tokens;
    w_uk: [H, Dn, R]; w_uv: [H, Dv, R]. Returns [T, H, Dv] in q's dtype; scores, softmax and
    sums in fp32 (dots of fp32 inputs in IEEE fp32, of bf16 ones in bf16).

    Sequences with more than VERIFY_MAX_TOKENS new tokens (prefill chunks) take the expanded
    form (`mla_prefill_sdpa`); decodes and verifies the absorbed kernel. A batch of decodes
    only (T == B) is told apart by its shapes, a verify by `max_seqlen`: no value is read
    back, as a CUDA graph needs."""
    T, B = q_nope.shape[0], cu_seqlens.shape[0] - 1
    if not max_seqlen and T > B:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    if T == B or max_seqlen <= VERIFY_MAX_TOKENS:
        return mla_absorbed_triton(q_nope, q_pe, kv_cache, block_table, cu_seqlens,
                                   context_lens, w_uk, w_uv, scale)
    return mla_split_chunks(mla_absorbed_triton, mla_prefill_sdpa_all, q_nope, q_pe,
                            kv_cache, block_table, cu_seqlens, context_lens, w_uk, w_uv, scale)


def mla_prefill_sdpa_all(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                         block_table: torch.Tensor, cu_seqlens: torch.Tensor,
                         context_lens: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """`mla_attention_triton`'s contract, each sequence through `mla_prefill_sdpa`."""
    cu, ctx = cu_seqlens.tolist(), context_lens.tolist()
    w_kvb = torch.cat([w_uk, w_uv], dim=1)
    out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        out[s:e] = mla_prefill_sdpa(q_nope[s:e], q_pe[s:e], kv_cache, block_table[b], ctx[b],
                                    w_kvb, scale)
    return out


def mla_prefill_sdpa(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                     block_table: torch.Tensor, context_len: int, w_kvb: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One sequence's n new tokens (the last n of its context_len cached latents) in the
    expanded form, as prefill runs MLA in SGLang and vLLM: the latents go through kv_b_proj
    once (k_nope and v per head, one GEMM), and the attention runs in Dn + Dr and Dv
    dimensions in torch's fused SDPA with the causal mask aligned to the last key. The
    absorbed form would score each query in R + Dr dimensions and sum R-wide latents: ~3x
    the FLOPs at Kimi's shapes, in a kernel built for few queries. w_kvb: [H, Dn + Dv, R]
    (W_UK then W_UV per head). Returns [n, H, Dv] in q's dtype."""
    n, c = q_nope.shape[0], context_len
    H, Dn, R = q_nope.shape[1], q_nope.shape[2], w_kvb.shape[2]
    dt = q_nope.dtype
    lat = gather_latent(kv_cache, block_table.to(kv_cache.device), c).to(dt)
    kv = F.linear(lat[:, :R], w_kvb.reshape(-1, R).to(dt)).view(c, H, -1)
    k = torch.cat([kv[..., :Dn], lat[:, R:].unsqueeze(1).expand(c, H, -1)], dim=-1)
    q = torch.cat([q_nope, q_pe.to(dt)], dim=-1)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], kv[..., Dn:].transpose(0, 1)[None],
        attn_mask=causal_lower_right(n, c), scale=scale)
    return o[0].transpose(0, 1)


def mla_absorbed_triton(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                        block_table: torch.Tensor, cu_seqlens: torch.Tensor,
                        context_lens: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """`mla_attention_triton`'s contract in the absorbed split kernel, for any batch."""
    T, H, _ = q_nope.shape
    R, DR = w_uk.shape[-1], q_pe.shape[-1]
    if T == 0:
        return q_nope.new_empty(0, H, w_uv.shape[1])
    dev, dt = q_nope.device, kv_cache.dtype
    kv = kv_cache.contiguous()
    # each token's sequence and absolute position (its keys are 0..last)
    tok = torch.arange(T, device=dev)
    cu = cu_seqlens.to(dev, torch.int64)
    seq = torch.searchsorted(cu[1:], tok, right=True)
    last = context_lens.to(dev, torch.int64)[seq] - (cu[seq + 1] - tok)
    q_lat = torch.einsum("thd,hdr->thr", q_nope.float(), w_uk.float()).to(dt).contiguous()
    qp = q_pe.to(dt).contiguous()
    # the splits cover what the block table can address, not the longest context: a bound
    # from shapes alone, so no value is read back to the host and the call can sit in a CUDA
    # graph (whose block table is as wide as a request may grow; splits past a token's
    # context exit at once)
    longest = block_table.shape[1] * kv.shape[1]
    head_blocks = -(-H // BLOCK_H)
    num_splits = max(1, min(-(-longest // SPLIT_LEN), TARGET_PROGRAMS // (T * head_blocks)))
    o = torch.empty(T, num_splits, H, R, dtype=torch.float32, device=dev)
    m = torch.empty(T, num_splits, H, dtype=torch.float32, device=dev)
    l_ = torch.empty(T, num_splits, H, dtype=torch.float32, device=dev)
    bt = block_table.to(dev, torch.int64).contiguous()
    fp32 = dt == torch.float32
    # fp32 latent tiles are twice bf16's: fewer pipeline stages to hold them
    _kernel()[(T, head_blocks, num_splits)](
        q_lat, qp, kv, bt, seq, last, o, m, l_, H, R, DR, bt.shape[1], kv.shape[1], num_splits,
        scale, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, BLOCK_R=tile(R),
        BLOCK_DR=tile(DR), PRECISION="ieee" if fp32 else "tf32",
        num_warps=8, num_stages=1 if fp32 else 2)
    # merge the splits (a split past a token's context has max -inf and weight 0)
    weight = torch.exp(m - m.max(1, keepdim=True).values)  # [T, S, H]
    o_lat = (o * weight[..., None]).sum(1) / (l_ * weight).sum(1)[..., None]
    return torch.einsum("thr,hvr->thv", o_lat, w_uv.float()).to(q_nope.dtype)
