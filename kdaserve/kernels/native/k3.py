"""The native CPU kernels of Kimi K3's additions, behind their ops' contracts: SiTU-GLU
(`situ_mul`), MLA's output gate (`sigmoid_mul`), the Attention Residuals mix fused with the
RMSNorm after it (`attn_res_norm`),
and MXFP4 experts (`moe_experts` with uint8 weights, which `ops.moe_experts_native` hands
here). Each falls back to its plain-torch reference for what its C++ does not take."""

from __future__ import annotations

import torch

from kdaserve.kernels.native.build import library
from kdaserve.kernels.native.tensors import f32 as _f32
from kdaserve.kernels.native.tensors import ptr as _p
from kdaserve.kernels.ref.attn_res import attn_res_norm_ref
from kdaserve.kernels.ref.mlp import sigmoid_mul_ref, situ_mul_ref
from kdaserve.kernels.ref.moe import moe_experts_ref


def situ_mul_native(gate_up: torch.Tensor, beta: float,
                    linear_beta: float | None) -> torch.Tensor:
    """`situ_mul_ref`'s contract (K3's SiTU-GLU of [..., gate | up]) in one C++ pass."""
    if gate_up.dtype != torch.float32 or not gate_up.is_cpu or beta <= 0 \
            or (linear_beta is not None and linear_beta <= 0):
        return situ_mul_ref(gate_up, beta, linear_beta)
    x = gate_up.contiguous()
    inter = x.shape[-1] // 2
    y = x.new_empty(*x.shape[:-1], inter)
    library().situ_mul_f32(x.data_ptr(), y.data_ptr(), x.numel() // (2 * inter) if inter else 0,
                           inter, beta, linear_beta or 0.0)
    return y


def sigmoid_mul_native(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`sigmoid_mul_ref`'s contract (x * sigmoid(gate)) in one C++ pass: the one-call decode
    step (csrc/decode_step.cpp) gates K3's MLA output with the same function."""
    if not _f32(x, gate) or x.shape != gate.shape:
        return sigmoid_mul_ref(x, gate)
    x, gate = x.contiguous(), gate.contiguous()
    y = torch.empty_like(x)
    library().sigmoid_mul_f32(_p(x), _p(gate), _p(y), x.numel())
    return y


def attn_res_norm_native(bank: torch.Tensor, partial: torch.Tensor, w_eff: torch.Tensor,
                         eps: float, norm_weight: torch.Tensor,
                         norm_eps: float) -> torch.Tensor:
    """`attn_res_norm_ref`'s contract (K3's AttnRes mix and the RMSNorm after it) in one C++
    pass per token: each source read once for its score, once for the mix."""
    NB, (T, D) = bank.shape[0], partial.shape
    if not _f32(bank, partial, w_eff, norm_weight) or NB + 1 > 64:
        return attn_res_norm_ref(bank, partial, w_eff, eps, norm_weight, norm_eps)
    bank, partial, w_eff, norm_weight = (
        t.contiguous() for t in (bank, partial, w_eff, norm_weight))
    out = torch.empty_like(partial)
    library().attn_res_norm_f32(_p(bank), NB, _p(partial), _p(w_eff), eps,
                                _p(norm_weight), norm_eps, _p(out), T, D)
    return out


def moe_experts_mxfp4(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                      w13: torch.Tensor, w2: torch.Tensor, scale13: torch.Tensor | None,
                      scale2: torch.Tensor | None,
                      situ: tuple[float, float | None] | None) -> torch.Tensor:
    """MXFP4 experts in one C++ call (csrc/mxfp4_cpu.cpp), held packed: the decode path
    reads 0.53 bytes a parameter, looked up in registers."""
    if scale13 is None or scale2 is None:
        raise ValueError("MXFP4 experts come with their E8M0 scales")
    if not _f32(x) or not all(t.is_contiguous() and t.is_cpu
                             for t in (w13, w2, scale13, scale2)):
        return moe_experts_ref(x, weights, ids, w13, w2, scale13, scale2, situ=situ)
    beta, linear_beta = (situ[0], situ[1] or 0.0) if situ else (0.0, 0.0)
    x = x.contiguous()
    out = torch.empty_like(x)
    T, k = ids.shape
    E, inter, D = w13.shape[0], w2.shape[-1] * 2, x.shape[1]
    ids, weights = ids.to(torch.int64).contiguous(), weights.float().contiguous()  # held
    if T:
        library().moe_experts_mxfp4(_p(x), _p(ids), _p(weights), _p(w13),
                                   _p(scale13), _p(w2), _p(scale2), _p(out), T, k, E,
                                   inter, D, beta, linear_beta)
    return out
