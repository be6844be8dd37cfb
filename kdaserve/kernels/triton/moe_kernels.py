"""The fused MoE's Triton kernels (`kdaserve/kernels/triton/moe.py` launches them). This module
imports triton at import: only `moe._kernels` imports it, on the first call."""

from __future__ import annotations

import triton
import triton.language as tl

from kdaserve.kernels.triton.k3_kernels import situ


@triton.jit
def block_rows(pairs_ptr, block_expert_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """This program's block: its expert (-1: unused), sorted rows, pairs, and which
    rows hold a pair (the rest pad the expert's run)."""
    b = tl.program_id(0)
    rows = b * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    return tl.load(block_expert_ptr + b), rows, pair, pair < num_pairs


@triton.jit
def mxfp4_tile(codes_ptr, scales_ptr, rows, ks, row_len, mask):
    """fp32 [BLOCK_K, BLOCK_N] of an MXFP4 weight [N, row_len] held as codes uint8 [N, row_len
    / 2] (the low nibble the even element) and E8M0 scales uint8 [N, row_len / 32]: element
    (k, n) is weight[rows[n], ks[k]]. Each value is its E2M1 magnitude times 2^(s - 127), both
    exact in fp32 (kernels/ref/mxfp4.py's dequantize_mxfp4, decoded in registers)."""
    byte = tl.load(codes_ptr + rows[None, :] * (row_len // 2) + ks[:, None] // 2, mask=mask,
                   other=0).to(tl.int32)
    code = (byte >> ((ks[:, None] % 2) * 4)) & 0xF
    e = (code >> 1) & 3  # E2M1: 2 exponent bits, 1 mantissa bit; e == 0 is subnormal
    f = (code & 1).to(tl.float32)  # magnitudes 0, 0.5 | 1, 1.5 | 2, 3 | 4, 6
    mag = tl.where(e == 0, 0.5 * f, tl.where(e == 1, 1.0 + 0.5 * f,
                                             tl.where(e == 2, 2.0 + f, 4.0 + 2.0 * f)))
    mag = tl.where((code & 8) != 0, -mag, mag)
    s = tl.load(scales_ptr + rows[None, :] * (row_len // 32) + ks[:, None] // 32, mask=mask,
                other=127).to(tl.int32)
    # 2^(s - 127) as its bits: a normal float's exponent field, s = 0 the subnormal 2^-127,
    # s = 255 infinity (as compressed-tensors decodes it)
    scale = tl.where(s == 0, 0x400000, s << 23).to(tl.float32, bitcast=True)
    return mag * scale


@triton.jit
def gate_up_kernel(x_ptr, w_ptr, s_ptr, pairs_ptr, block_expert_ptr, h_ptr,
                   num_pairs, top_k, D, inter, beta, linear_beta,
                   HAS_SCALE: tl.constexpr, SITU: tl.constexpr, CAP_UP: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, MXFP4: tl.constexpr):
    """MXFP4: w_ptr the codes [E, 2I, D / 2], s_ptr the scales [E, 2I, D / 32], decoded in
    the K loop (W4A16); else w_ptr the weights, s_ptr int8's row scales (HAS_SCALE)."""
    e, rows, pair, valid = block_rows(pairs_ptr, block_expert_ptr, num_pairs, BLOCK_M)
    if e < 0:
        return
    tok = tl.where(valid, pair // top_k, 0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    w_e = w_ptr + e * (2 * inter) * (D // 2 if MXFP4 else D)
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k_ok = (k0 + ks) < D
        a = tl.load(x_ptr + tok[:, None] * D + (k0 + ks)[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        wmask = k_ok[:, None] & col_ok[None, :]
        if MXFP4:
            s_e = s_ptr + e * (2 * inter) * (D // 32)
            w1 = mxfp4_tile(w_e, s_e, cols, k0 + ks, D, wmask)
            w3 = mxfp4_tile(w_e, s_e, inter + cols, k0 + ks, D, wmask)
        else:
            w1 = tl.load(w_e + cols[None, :] * D + (k0 + ks)[:, None], mask=wmask, other=0.0)
            w3 = tl.load(w_e + (inter + cols)[None, :] * D + (k0 + ks)[:, None], mask=wmask,
                         other=0.0)
        gate = tl.dot(a, w1.to(a.dtype), gate, input_precision=PRECISION)
        up = tl.dot(a, w3.to(a.dtype), up, input_precision=PRECISION)
    if HAS_SCALE:
        s_e = s_ptr + e * (2 * inter)
        gate = gate * tl.load(s_e + cols, mask=col_ok, other=0.0)[None, :]
        up = up * tl.load(s_e + inter + cols, mask=col_ok, other=0.0)[None, :]
    if SITU:  # K3: from the projections rounded as the unfused path's are
        h = situ(gate.to(h_ptr.dtype.element_ty).to(tl.float32),
                 up.to(h_ptr.dtype.element_ty).to(tl.float32), beta, linear_beta, CAP_UP)
    else:
        h = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(h_ptr + rows[:, None] * inter + cols[None, :], h.to(h_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


@triton.jit
def down_kernel(h_ptr, w_ptr, s_ptr, pairs_ptr, block_expert_ptr, weights_ptr, out_ptr,
                num_pairs, D, inter,
                HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, MXFP4: tl.constexpr):
    """MXFP4 as in gate_up_kernel: codes [E, D, I / 2], scales [E, D, I / 32]."""
    e, rows, pair, valid = block_rows(pairs_ptr, block_expert_ptr, num_pairs, BLOCK_M)
    if e < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < D
    ks = tl.arange(0, BLOCK_K)
    w_e = w_ptr + e * D * (inter // 2 if MXFP4 else inter)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = (k0 + ks) < inter
        a = tl.load(h_ptr + rows[:, None] * inter + (k0 + ks)[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        wmask = k_ok[:, None] & col_ok[None, :]
        if MXFP4:
            w = mxfp4_tile(w_e, s_ptr + e * D * (inter // 32), cols, k0 + ks, inter, wmask)
        else:
            w = tl.load(w_e + cols[None, :] * inter + (k0 + ks)[:, None], mask=wmask,
                        other=0.0)
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=PRECISION)
    if HAS_SCALE:
        acc = acc * tl.load(s_ptr + e * D + cols, mask=col_ok, other=0.0)[None, :]
    weight = tl.load(weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    tl.store(out_ptr + pair[:, None] * D + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


@triton.jit
def keep_top_groups(choice, es, group_size, NUM_GROUP: tl.constexpr,
                    TOPK_GROUP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr):
    """DeepSeek-V3's group-limited choice: each group of `group_size` consecutive experts
    scores the sum of its best two choices; experts outside the TOPK_GROUP best groups drop
    to -inf."""
    group = es // group_size
    gs = tl.arange(0, BLOCK_G)
    scores = tl.full((BLOCK_T, BLOCK_G), float("-inf"), dtype=tl.float32)
    for g in tl.static_range(NUM_GROUP):
        mine = tl.where((group == g)[None, :], choice, float("-inf"))
        best = tl.argmax(mine, 1)
        first = tl.max(mine, 1)
        # a group of one expert has no second: its score is its one choice
        second = tl.max(tl.where(es[None, :] == best[:, None], float("-inf"), mine), 1)
        score = tl.where(second == float("-inf"), first, first + second)
        scores = tl.where(gs[None, :] == g, score[:, None], scores)
    keep = tl.zeros_like(choice) != 0
    for _ in tl.static_range(TOPK_GROUP):
        g = tl.argmax(scores, 1)
        keep = keep | (group[None, :] == g[:, None])
        scores = tl.where(gs[None, :] == g[:, None], float("-inf"), scores)
    return tl.where(keep, choice, float("-inf"))


@triton.jit
def route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, T, E, scaling,
                 HAS_BIAS: tl.constexpr, SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr,
                 TOP_K: tl.constexpr, NUM_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_G: tl.constexpr):
    """BLOCK_T tokens' routing: scores (sigmoid or softmax), the bias added for selection
    only, the groups limited to the best TOPK_GROUP where NUM_GROUP > 1, the top k by
    repeated argmax (ties to the lower expert), the unbiased scores of the chosen as
    weights, renormalised and scaled."""
    ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    es = tl.arange(0, BLOCK_E)
    t_ok, e_ok = ts < T, es < E
    x = tl.load(logits_ptr + ts[:, None] * E + es[None, :],
                mask=t_ok[:, None] & e_ok[None, :], other=float("-inf")).to(tl.float32)
    x = tl.where(t_ok[:, None], x, 0.0)  # rows past T: finite, so no NaN in their softmax
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        p = tl.exp(x - tl.max(x, 1)[:, None])
        scores = p / tl.sum(p, 1)[:, None]
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + es, mask=e_ok, other=0.0)[None, :]
    choice = tl.where(e_ok[None, :], choice, float("-inf"))
    if NUM_GROUP > 1:
        choice = keep_top_groups(choice, es, E // NUM_GROUP, NUM_GROUP, TOPK_GROUP, BLOCK_T,
                                 BLOCK_G)
    ks = tl.arange(0, BLOCK_K)
    w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    ids = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int64)
    for i in tl.static_range(TOP_K):
        best = tl.argmax(choice, 1)
        hit = es[None, :] == best[:, None]
        w = tl.where(ks[None, :] == i, tl.sum(tl.where(hit, scores, 0.0), 1)[:, None], w)
        ids = tl.where(ks[None, :] == i, best[:, None].to(tl.int64), ids)
        choice = tl.where(hit, float("-inf"), choice)
    if RENORMALIZE:
        w = w / (tl.sum(w, 1)[:, None] + 1e-20)
    out = ts[:, None] * TOP_K + ks[None, :]
    k_ok = t_ok[:, None] & (ks < TOP_K)[None, :]
    tl.store(weights_ptr + out, w * scaling, mask=k_ok)
    tl.store(ids_ptr + out, ids, mask=k_ok)
