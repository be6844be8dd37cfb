"""KDA prefill through fla-core's Triton kernels; decode (a token or a few per sequence)
through our fused kernel (`kda_kernels.py`), fla's where a head's state is too large for it.

fla applies our activations in-kernel with the same numerics as kernels/ref/kda.py: l2norm
x / sqrt(sum x^2 + 1e-6) on q and k, gate -exp(A_log) * softplus(g + dt_bias) (softplus
threshold 20), or K3's lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) (fla's
`lower_bound`), and sigmoid(beta). Packed [T, ...] tensors become fla's varlen [1, T, ...].
"""

from __future__ import annotations

from typing import Any

import torch

from kdaserve.kernels.ref.kda import Snapshots, compose_kda_decode, kda_chunk_in_segments
from kdaserve.kernels.triton import jit_module, tile
from kdaserve.kernels.triton.conv import short_conv_triton

# a program holds one head's [K, V] fp32 state in registers: Kimi's 128 x 128 is 64 KB over
# 8 warps (64 values a thread, 255 registers in all on sm_90 without spills, compiled ahead
# of time); a larger head goes to fla's kernel, which splits V
FUSED_MAX_STATE = 128 * 128


def _kernels() -> Any:
    return jit_module("kda_kernels")


def kda_decode_fused(qkv: torch.Tensor, f: torch.Tensor, beta: torch.Tensor, z: torch.Tensor,
                     conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                     norm_weight: torch.Tensor, eps: float, state: torch.Tensor,
                     conv_state: torch.Tensor, state_slots: torch.Tensor,
                     cu_seqlens: torch.Tensor | None = None,
                     lower_bound: float | None = None) -> torch.Tensor:
    """`kda_decode_ref`'s contract in one launch, a program per (sequence, head): the short
    conv, the activations, the delta rule and the gated norm of each new token (unfused: a
    conv launch, three split copies, fla's recurrence, fla's norm). Needs contiguous pools."""
    T, H, K = f.shape
    V = z.shape[-1]
    D = qkv.shape[1]
    W = conv_weight.shape[1]
    dev = qkv.device
    # one token each: [0, 1, ..., T] without a host tensor (a CUDA graph captures it)
    cu = torch.arange(T + 1, device=dev) if cu_seqlens is None else cu_seqlens.to(dev)
    B = cu.shape[0] - 1
    out = torch.empty(T, H, V, dtype=qkv.dtype, device=dev)
    if T == 0:
        return out
    _kernels().kda_decode_kernel[(B, H)](
        qkv.contiguous(), f.contiguous(), beta.contiguous(), z.contiguous(),
        conv_weight.contiguous(), A_log.contiguous(), dt_bias.contiguous(),
        norm_weight.contiguous(), state, conv_state, state_slots.to(dev).contiguous(),
        cu.to(torch.int64).contiguous(), out, eps, K ** -0.5, lower_bound or 0.0, H, D,
        LOWER_BOUND=lower_bound is not None, K=K, V=V, W=W,
        BLOCK_K=tile(K), BLOCK_V=tile(V), BLOCK_W=tile(W - 1, least=2),
        BLOCK_TAPS=tile(W, least=2),
        num_warps=8 if tile(K) * tile(V) >= 128 * 128 else 4)
    return out


def kda_chunk_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                     state: torch.Tensor, state_slots: torch.Tensor, cu_seqlens: torch.Tensor,
                     snapshots: Snapshots | None = None,
                     lower_bound: float | None = None) -> torch.Tensor:
    """`kda_chunk_ref`'s contract: q, k: [T, H, K]; v: [T, H, V]; g: [T, H, K] raw gate;
    beta: [T, H] logits; state: [N, H, K, V] fp32 pool updated through state_slots [B];
    cu_seqlens: [B+1]. Returns [T, H, V] in v.dtype. Snapshots: the sequences that have
    them run in segments (fla returns only final states)."""
    from fla.ops.kda import chunk_kda

    if snapshots is not None and snapshots[0].numel():
        return kda_chunk_in_segments(kda_chunk_triton, q, k, v, g, beta, A_log, dt_bias, state,
                                     state_slots, cu_seqlens, snapshots,
                                     lower_bound=lower_bound)

    slots = state_slots.to(device=q.device, dtype=torch.long)
    o, final = chunk_kda(
        q[None], k[None], v[None], g[None], beta[None],
        initial_state=state.index_select(0, slots).float(), output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        A_log=A_log.float(), dt_bias=dt_bias.float(), lower_bound=lower_bound,
        cu_seqlens=cu_seqlens.to(device=q.device, dtype=torch.long))
    state.index_copy_(0, slots, final.to(state.dtype))
    return o[0].to(v.dtype)


def kda_decode_triton(qkv: torch.Tensor, f: torch.Tensor, beta: torch.Tensor, z: torch.Tensor,
                      conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                      norm_weight: torch.Tensor, eps: float, state: torch.Tensor,
                      conv_state: torch.Tensor, state_slots: torch.Tensor,
                      cu_seqlens: torch.Tensor | None = None,
                      lower_bound: float | None = None) -> torch.Tensor:
    """`kda_decode_ref`'s contract: our fused kernel (`kda_decode_fused`). Where a head is
    too large for it, fla's: for one token each, the delta rule reads and writes the pool rows
    in place through fla's `ssm_state_indices` (no gather copy), the conv ours (`conv.py`:
    fla's conv cache is [N, D, W] in batch order, not our slots); for a few tokens per
    sequence (`cu_seqlens`), the short conv, fla's chunk form, the norm."""
    if state.is_contiguous() and conv_state.is_contiguous() and \
            tile(f.shape[-1]) * tile(z.shape[-1]) <= FUSED_MAX_STATE:
        return kda_decode_fused(qkv, f, beta, z, conv_weight, A_log, dt_bias, norm_weight,
                                eps, state, conv_state, state_slots, cu_seqlens, lower_bound)
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    if cu_seqlens is not None:
        return compose_kda_decode(short_conv_triton, kda_chunk_triton, qkv, f, beta, z,
                                  conv_weight, A_log, dt_bias, norm_weight, eps, state,
                                  conv_state, state_slots, cu_seqlens, lower_bound=lower_bound)
    B, H, K = f.shape
    x = short_conv_triton(qkv, conv_weight, conv_state, state_slots,
                          torch.arange(B + 1, device=qkv.device))
    q, k, v = (t.reshape(B, 1, H, -1).contiguous() for t in x.split([H * K, H * K,
                                                                       x.shape[1] - 2 * H * K], 1))
    slots = state_slots.to(device=qkv.device, dtype=torch.long)
    pool = state if state.is_contiguous() and state.dtype == torch.float32 else \
        state.index_select(0, slots).float()
    o, _ = fused_recurrent_kda_fwd(
        q, k, v, f.reshape(B, 1, H, K).contiguous(), beta.reshape(B, 1, H).contiguous(),
        A_log=A_log.float().contiguous(), dt_bias=dt_bias.float().contiguous(),
        initial_state=pool, inplace_final_state=True,
        ssm_state_indices=slots if pool is state else torch.arange(B, device=qkv.device),
        lower_bound=lower_bound,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    if pool is not state:
        state.index_copy_(0, slots, pool.to(state.dtype))
    return rms_norm_gated(o.view(B, H, -1), z, norm_weight, None, activation="sigmoid", eps=eps)
