"""KDA's fused decode step in Triton (`kdaserve/kernels/triton/kda.py` launches it). This
module imports triton at import: only `kda._kernels` imports it, on the first call."""

from __future__ import annotations

import triton
import triton.language as tl

from kdaserve.kernels.triton.conv_kernels import conv_at, conv_taps, next_conv_state


@triton.jit
def kda_decode_kernel(qkv_ptr, f_ptr, beta_ptr, z_ptr, conv_w_ptr, A_log_ptr, dt_bias_ptr,
                      norm_w_ptr, state_ptr, conv_ptr, slot_ptr, cu_ptr, out_ptr, eps, scale,
                      lower_bound, H, D, LOWER_BOUND: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, W: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_W: tl.constexpr,
                      BLOCK_TAPS: tl.constexpr):
    """One sequence's head, its new tokens in order: short conv + SiLU of its q, k and v
    channels, l2norm of q and k, the gate -exp(A_log) * softplus(f + dt_bias) (or with
    LOWER_BOUND K3's lower_bound * sigmoid(exp(A_log) * (f + dt_bias))), sigmoid(beta),
    the delta rule on its [K, V] state held in registers, then the gated RMSNorm of the output
    (a head's V values are one program's, so the norm needs no second pass). The state and
    the conv state are written once, after the last token."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    ks = tl.arange(0, BLOCK_K)
    vs = tl.arange(0, BLOCK_V)
    k_ok = ks < K
    v_ok = vs < V
    cq = h * K + ks
    ck = H * K + h * K + ks
    cv = 2 * H * K + h * V + vs
    s_ok = k_ok[:, None] & v_ok[None, :]
    S = tl.load(state_ptr + ((slot * H + h) * K + ks[:, None]) * V + vs[None, :], mask=s_ok,
                other=0.0).to(tl.float32)
    A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    dt = tl.load(dt_bias_ptr + h * K + ks, mask=k_ok, other=0.0).to(tl.float32)
    nw = tl.load(norm_w_ptr + vs, mask=v_ok, other=0.0).to(tl.float32)
    # the taps once, as tiles: kept per channel as pointer vectors they spilled registers
    # (sm_90, K = V = 128: 255 registers and 464 bytes of stack; 0 with tiles)
    wq = conv_taps(conv_w_ptr, cq, k_ok, W, BLOCK_TAPS)
    wk = conv_taps(conv_w_ptr, ck, k_ok, W, BLOCK_TAPS)
    wv = conv_taps(conv_w_ptr, cv, v_ok, W, BLOCK_TAPS)
    dt_in = qkv_ptr.dtype.element_ty
    for pos in range(n):
        t = start + pos
        # rounded to the input's dtype, as the unfused conv's output is
        q = conv_at(qkv_ptr, wq, conv_ptr, slot, start, pos, cq, k_ok, D, W, BLOCK_TAPS)
        q = q.to(dt_in).to(tl.float32)
        k = conv_at(qkv_ptr, wk, conv_ptr, slot, start, pos, ck, k_ok, D, W, BLOCK_TAPS)
        k = k.to(dt_in).to(tl.float32)
        v = conv_at(qkv_ptr, wv, conv_ptr, slot, start, pos, cv, v_ok, D, W, BLOCK_TAPS)
        v = v.to(dt_in).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6)  # fla's l2norm: eps inside the root
        k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
        g = tl.load(f_ptr + (t * H + h) * K + ks, mask=k_ok, other=0.0).to(tl.float32) + dt
        if LOWER_BOUND:  # log-decay in [lower_bound, 0]; A = -exp(A_log)
            decay = lower_bound / (1.0 + tl.exp(A * g))
        else:
            decay = A * tl.where(g > 20.0, g, tl.log(1.0 + tl.exp(tl.minimum(g, 20.0))))
        beta = tl.load(beta_ptr + t * H + h).to(tl.float32)
        beta = 1.0 / (1.0 + tl.exp(-beta))
        S = S * tl.exp(decay)[:, None]
        delta = (v - tl.sum(k[:, None] * S, 0)) * beta
        S = S + k[:, None] * delta[None, :]
        o = tl.sum((q * scale)[:, None] * S, 0)
        o = o.to(out_ptr.dtype.element_ty).to(tl.float32)  # as the unfused output is
        rms = tl.rsqrt(tl.sum(tl.where(v_ok, o * o, 0.0), 0) / V + eps)
        z = tl.load(z_ptr + (t * H + h) * V + vs, mask=v_ok, other=0.0).to(tl.float32)
        y = nw * o * rms / (1.0 + tl.exp(-z))
        tl.store(out_ptr + (t * H + h) * V + vs, y.to(out_ptr.dtype.element_ty), mask=v_ok)
    # pointers built again, not kept from the load: live across the loop they spilled too
    k2 = tl.arange(0, BLOCK_K)
    v2 = tl.arange(0, BLOCK_V)
    tl.store(state_ptr + ((slot * H + h) * K) * V + (k2 * V)[:, None] + v2[None, :],
             S.to(state_ptr.dtype.element_ty), mask=(k2 < K)[:, None] & (v2 < V)[None, :])
    nq = next_conv_state(qkv_ptr, conv_ptr, slot, start, n, cq, k_ok, D, W, BLOCK_W)
    nk = next_conv_state(qkv_ptr, conv_ptr, slot, start, n, ck, k_ok, D, W, BLOCK_W)
    nv = next_conv_state(qkv_ptr, conv_ptr, slot, start, n, cv, v_ok, D, W, BLOCK_W)
    # row r takes what row n + r held: every thread's reads (the loop's too) land before
    # any write (Triton orders only shared memory by itself)
    tl.debug_barrier()
    rows = tl.arange(0, BLOCK_W)
    row_ok = (rows < W - 1)[:, None]
    base = conv_ptr + (slot * (W - 1) + rows)[:, None] * D
    tl.store(base + cq[None, :], nq, mask=row_ok & k_ok[None, :])
    tl.store(base + ck[None, :], nk, mask=row_ok & k_ok[None, :])
    tl.store(base + cv[None, :], nv, mask=row_ok & v_ok[None, :])
