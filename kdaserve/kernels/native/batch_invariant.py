"""The `batch_invariant` backend: every op of the forward in kernels whose result for a row does
not depend on the other rows of the call (csrc/batch_invariant.cpp explains how), for
deterministic inference (`EngineConfig.enable_deterministic_inference`).

A request's tokens then go through the same operations whatever it is batched with, however
its prompt is chunked, and whether its prefix came from the cache: decode rows take the
prefill path (`kda_decode` here is the composition of the prefill ops, not a fused kernel), and
the KDA delta rule is the token-serial scan, which carries the state in fp32 from token to
token the same way across any chunk boundary. These wrappers never fall back to another
backend: an input they cannot take is an error, because a silent fallback would break the
guarantee rather than the speed.
"""

from __future__ import annotations

import torch

from kdaserve.kernels.native.build import MAX_HEAD_DIM, library
from kdaserve.kernels.native.ops import kda_chunk_native
from kdaserve.kernels.ref.kda import Snapshots
from kdaserve.kernels.ref.moe import moe_route_ref


def _lib():
    return library("batch_invariant")


def _check(*ts: torch.Tensor) -> None:
    for t in ts:
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError("deterministic inference runs fp32 on the CPU; got a "
                             f"{t.dtype} tensor on {t.device}")


def _no_scales(*scales: torch.Tensor | None) -> None:
    if any(s is not None for s in scales):
        raise ValueError("deterministic inference runs unquantized fp32 weights")


def linear_bi(x: torch.Tensor, weight: torch.Tensor,
              scale: torch.Tensor | None = None) -> torch.Tensor:
    _no_scales(scale)
    _check(x, weight)
    K = x.shape[-1]
    N = weight.shape[0]
    x2, w = x.reshape(-1, K).contiguous(), weight.contiguous()
    y = torch.empty(x2.shape[0], N, dtype=torch.float32)
    if x2.shape[0]:
        _lib().bi_linear_f32(x2.data_ptr(), w.data_ptr(), y.data_ptr(), x2.shape[0], N, K)
    return y.view(*x.shape[:-1], N)


def rms_norm_bi(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check(x, weight)
    return rms_norm_rows(x, weight, eps)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The row norm without `_check` (fp32 CPU tensors: the caller knows): the `native`
    backend's `rms_norm`, where a decode step's dozen calls make the check a cost."""
    xc, w = x.contiguous(), weight.contiguous()
    y = torch.empty_like(xc)
    D = x.shape[-1]
    _lib().bi_rms_norm_f32(xc.data_ptr(), w.data_ptr(), y.data_ptr(), xc.numel() // D, D, eps)
    return y


def gated_rmsnorm_bi(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
    _check(o, gate, weight)
    oc, zc, w = o.contiguous(), gate.contiguous(), weight.contiguous()
    y = torch.empty_like(oc)
    D = o.shape[-1]
    _lib().bi_gated_rms_norm_f32(oc.data_ptr(), zc.data_ptr(), w.data_ptr(), y.data_ptr(),
                                 oc.numel() // D, D, eps)
    return y


def silu_mul_bi(gate_up: torch.Tensor) -> torch.Tensor:
    _check(gate_up)
    x = gate_up.contiguous()
    inter = x.shape[-1] // 2
    y = torch.empty(*x.shape[:-1], inter, dtype=torch.float32)
    _lib().bi_silu_mul_f32(x.data_ptr(), y.data_ptr(), x.numel() // (2 * inter), inter)
    return y


def situ_mul_bi(gate_up: torch.Tensor, beta: float,
                linear_beta: float | None) -> torch.Tensor:
    _check(gate_up)
    x = gate_up.contiguous()
    inter = x.shape[-1] // 2
    y = torch.empty(*x.shape[:-1], inter, dtype=torch.float32)
    if y.numel():
        _lib().bi_situ_mul_f32(x.data_ptr(), y.data_ptr(), x.numel() // (2 * inter), inter,
                               beta, linear_beta or 0.0)
    return y


def attn_res_norm_bi(bank: torch.Tensor, partial: torch.Tensor, w_eff: torch.Tensor, eps: float,
                     norm_weight: torch.Tensor, norm_eps: float) -> torch.Tensor:
    _check(bank, partial, w_eff, norm_weight)
    bank, partial, w_eff, norm_weight = (
        t.contiguous() for t in (bank, partial, w_eff, norm_weight))
    out = torch.empty_like(partial)
    T, D = partial.shape
    _lib().bi_attn_res_norm_f32(bank.data_ptr(), bank.shape[0], partial.data_ptr(),
                                w_eff.data_ptr(), eps, norm_weight.data_ptr(), norm_eps,
                                out.data_ptr(), T, D)
    return out


def sigmoid_bi(x: torch.Tensor) -> torch.Tensor:
    _check(x)
    xc = x.contiguous()
    y = torch.empty_like(xc)
    _lib().bi_sigmoid_f32(xc.data_ptr(), y.data_ptr(), xc.numel())
    return y


def sigmoid_mul_bi(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`sigmoid_mul_ref`'s contract: each element alone, so any batch gives the same values."""
    return x * sigmoid_bi(gate)


def short_conv_bi(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                  state_slots: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    _check(x, weight, conv_state)
    if not conv_state.is_contiguous():
        raise ValueError("short_conv needs a contiguous conv-state pool")
    # every tensor whose pointer is passed is bound to a name: a temporary would be freed
    # before the call
    xc, w = x.contiguous(), weight.contiguous()
    slots, cu = state_slots.to(torch.int64).contiguous(), cu_seqlens.to(torch.int64).contiguous()
    out = torch.empty_like(xc)
    C, W = weight.shape
    _lib().bi_short_conv_f32(xc.data_ptr(), w.data_ptr(), conv_state.data_ptr(), slots.data_ptr(),
                             cu.data_ptr(), out.data_ptr(), cu.shape[0] - 1, C, W)
    return out


def kda_chunk_bi(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                 state: torch.Tensor, state_slots: torch.Tensor, cu_seqlens: torch.Tensor,
                 snapshots: Snapshots | None = None,
                 lower_bound: float | None = None) -> torch.Tensor:
    """The native token-serial scan (one thread per (sequence, head), tokens in order), held
    to what it needs instead of falling back."""
    _check(q, k, v, g, beta, A_log, dt_bias, state)
    if not state.is_contiguous() or max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        raise ValueError(f"the KDA scan needs a contiguous state and head dims <= {MAX_HEAD_DIM}")
    return kda_chunk_native(q, k, v, g, beta, A_log, dt_bias, state, state_slots, cu_seqlens,
                            snapshots, lower_bound)


def kda_decode_bi(qkv: torch.Tensor, f: torch.Tensor, beta: torch.Tensor, z: torch.Tensor,
                  conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                  norm_weight: torch.Tensor, eps: float, state: torch.Tensor,
                  conv_state: torch.Tensor, state_slots: torch.Tensor,
                  cu_seqlens: torch.Tensor | None = None,
                  lower_bound: float | None = None) -> torch.Tensor:
    """Exactly the prefill path of `KDAttention.forward` (every row batch-invariant)."""
    T, H, K = f.shape
    cu = torch.arange(T + 1) if cu_seqlens is None else cu_seqlens
    x = short_conv_bi(qkv, conv_weight, conv_state, state_slots, cu)
    q, k, v = (t.view(T, H, -1) for t in x.chunk(3, dim=-1))
    o = kda_chunk_bi(q, k, v, f, beta, A_log, dt_bias, state, state_slots, cu,
                     lower_bound=lower_bound)
    return gated_rmsnorm_bi(o, z, norm_weight, eps)


def mla_attention_bi(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                     block_table: torch.Tensor, cu_seqlens: torch.Tensor,
                     context_lens: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                     scale: float, max_seqlen: int = 0) -> torch.Tensor:
    _check(q_nope, q_pe, kv_cache, w_uk, w_uv)
    T, H, Dn = q_nope.shape
    R, Dv, Dr = w_uk.shape[-1], w_uv.shape[1], q_pe.shape[-1]
    if not kv_cache.is_contiguous() or w_uk.stride()[1:] != (R, 1) \
            or w_uv.stride()[1:] != (R, 1) or w_uk.stride(0) != w_uv.stride(0):
        raise ValueError("mla_attention needs a contiguous cache and W_UK / W_UV row-major "
                         "per head with one head stride")
    cu = cu_seqlens.to(torch.int64)
    n = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(n.shape[0]), n)
    # row i of a sequence with n new tokens and c cached ones (incl. the new) is at c - n + i
    pos = context_lens.to(torch.int64)[seq] - n[seq] + torch.arange(T) - cu[seq]
    table = block_table.to(torch.int64).contiguous()
    qn, qp, pos = q_nope.contiguous(), q_pe.contiguous(), pos.contiguous()
    out = torch.empty(T, H, Dv, dtype=torch.float32)
    if T:
        _lib().bi_mla_attention_f32(
            qn.data_ptr(), qp.data_ptr(), kv_cache.data_ptr(), table.data_ptr(), seq.data_ptr(),
            pos.data_ptr(), w_uk.data_ptr(), w_uv.data_ptr(), out.data_ptr(), T, H, Dn, Dr, R,
            Dv, w_uk.stride(0), kv_cache.shape[1], table.shape[1], scale)
    return out


def _sum_in_order(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim as elementwise adds, column by column (a fixed order)."""
    total = t[..., 0].clone()
    for j in range(1, t.shape[-1]):
        total += t[..., j]
    return total


def moe_route_bi(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, num_group: int,
                 topk_group: int, renormalize: bool, scaling: float,
                 activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_route_ref` with the native sigmoid and sums spelled out in order; selection (top-k,
    masks) is exact anyway, and torch's last-dim softmax runs each row from its start with the
    same vector code."""
    return moe_route_ref(logits, bias, top_k, num_group, topk_group, renormalize, scaling,
                         activation, sigmoid=sigmoid_bi, sum_last=_sum_in_order)


def moe_experts_bi(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   w13: torch.Tensor, w2: torch.Tensor, scale13: torch.Tensor | None = None,
                   scale2: torch.Tensor | None = None,
                   situ: tuple[float, float | None] | None = None) -> torch.Tensor:
    """fp32 experts, or MXFP4 ones (uint8 codes with their E8M0 scales, kernels/ref/mxfp4.py),
    each weight row decoded exactly: the values of fp32 experts holding the dequantized
    weights."""
    beta, linear_beta = (situ[0], situ[1] or 0.0) if situ else (0.0, 0.0)
    mxfp4 = w13.dtype == torch.uint8
    if mxfp4:
        if scale13 is None or scale2 is None:
            raise ValueError("MXFP4 experts come with their E8M0 scales")
        if any(t.dtype != torch.uint8 or not t.is_cpu for t in (w2, scale13, scale2)):
            raise ValueError("MXFP4 experts: uint8 codes and scales on the CPU")
        _check(x, weights)
    else:
        _no_scales(scale13, scale2)
        _check(x, weights, w13, w2)
    T, k = ids.shape
    xc, idc, wc = x.contiguous(), ids.to(torch.int64).contiguous(), weights.contiguous()
    w13c, w2c = w13.contiguous(), w2.contiguous()
    out = torch.empty_like(xc)
    E, D = w13.shape[0], x.shape[1]
    if T and mxfp4:
        s13, s2 = scale13.contiguous(), scale2.contiguous()  # type: ignore[union-attr]
        _lib().bi_moe_mxfp4(xc.data_ptr(), idc.data_ptr(), wc.data_ptr(), w13c.data_ptr(),
                            s13.data_ptr(), w2c.data_ptr(), s2.data_ptr(), out.data_ptr(), T,
                            k, E, w2.shape[-1] * 2, D, beta, linear_beta)
    elif T:
        _lib().bi_moe_f32(xc.data_ptr(), idc.data_ptr(), wc.data_ptr(), w13c.data_ptr(),
                          w2c.data_ptr(), out.data_ptr(), T, k, E, w2.shape[-1], D, beta,
                          linear_beta)
    return out
