"""Triton kernels of K3's own elementwise and per-token work: SiTU-GLU (also inlined in the
fused MoE's gate_up kernel) and the Attention Residuals mix fused with the RMSNorm after it
(`kdaserve/kernels/triton/k3.py` launches them). Imports triton at import: only `k3._kernels`
and `moe._kernels` import it, on the first call."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    """tanh from one exp of a non-positive argument: no overflow at any |x|."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def situ(gate, up, beta, linear_beta, CAP_UP: tl.constexpr):
    """SiTU-GLU of fp32 gate and up (situ_mul_ref): beta tanh(gate / beta) sigmoid(gate),
    times up soft-capped at linear_beta where CAP_UP."""
    a = beta * tanh(gate / beta) / (1.0 + tl.exp(-gate))
    if CAP_UP:
        up = linear_beta * tanh(up / linear_beta)
    return a * up


@triton.jit
def situ_mul_kernel(gu_ptr, y_ptr, inter, beta, linear_beta, CAP_UP: tl.constexpr,
                    BLOCK: tl.constexpr):
    """One row's block of columns: y[r, c] = situ(gu[r, c], gu[r, inter + c])."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    g = tl.load(gu_ptr + r * 2 * inter + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + r * 2 * inter + inter + cols, mask=ok, other=0.0).to(tl.float32)
    y = situ(g, u, beta, linear_beta, CAP_UP)
    tl.store(y_ptr + r * inter + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def attn_res_norm_kernel(bank_ptr, partial_ptr, w_ptr, norm_w_ptr, out_ptr, NB, T, D, eps,
                         norm_eps, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """One token: each of the NB + 1 sources scored w_eff . v / rms(v) in fp32 (a pass over
    each), the softmax over the scores, the un-normalised sources mixed and the mix's sum of
    squares taken (a second pass, the mix written as it goes), then the RMSNorm applied to
    the written mix (a third pass over one row)."""
    t = tl.program_id(0).to(tl.int64)
    js = tl.arange(0, BLOCK_S)
    ds = tl.arange(0, BLOCK_D)
    logit = tl.full((BLOCK_S,), float("-inf"), dtype=tl.float32)
    for j in range(NB + 1):
        src = partial_ptr + t * D  # source j: bank row j while j < NB, then the partial
        if j < NB:
            src = bank_ptr + (j * T + t) * D
        dot = tl.zeros((BLOCK_D,), dtype=tl.float32)
        ss = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            ok = d0 + ds < D
            v = tl.load(src + d0 + ds, mask=ok, other=0.0).to(tl.float32)
            dot += v * tl.load(w_ptr + d0 + ds, mask=ok, other=0.0).to(tl.float32)
            ss += v * v
        score = tl.sum(dot, 0) / tl.sqrt(tl.sum(ss, 0) / D + eps)
        logit = tl.where(js == j, score, logit)
    p = tl.exp(logit - tl.max(logit, 0))
    p = p / tl.sum(p, 0)
    out = out_ptr + t * D
    ms = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        ok = d0 + ds < D
        m = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for j in range(NB + 1):
            src = partial_ptr + t * D
            if j < NB:
                src = bank_ptr + (j * T + t) * D
            pj = tl.sum(tl.where(js == j, p, 0.0), 0)
            m += pj * tl.load(src + d0 + ds, mask=ok, other=0.0).to(tl.float32)
        # rounded as the unfused mix's output is, before its norm reads it
        m = m.to(out_ptr.dtype.element_ty).to(tl.float32)
        ms += tl.where(ok, m * m, 0.0)
        tl.store(out + d0 + ds, m.to(out_ptr.dtype.element_ty), mask=ok)
    r = 1.0 / tl.sqrt(tl.sum(ms, 0) / D + norm_eps)
    for d0 in range(0, D, BLOCK_D):
        ok = d0 + ds < D
        m = tl.load(out + d0 + ds, mask=ok, other=0.0).to(tl.float32)
        nw = tl.load(norm_w_ptr + d0 + ds, mask=ok, other=0.0).to(tl.float32)
        y = nw * (m * r).to(out_ptr.dtype.element_ty).to(tl.float32)  # as rms_norm_ref rounds
        tl.store(out + d0 + ds, y.to(out_ptr.dtype.element_ty), mask=ok)
