"""The paged MLA attention's Triton kernel (`kdaserve/kernels/triton/mla.py` launches it).
This module imports triton at import: only `mla._kernel` imports it, on the first call."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mla_split_kernel(q_lat_ptr, q_pe_ptr, kv_ptr, block_table_ptr, seq_ptr, last_ptr,
                     o_ptr, m_ptr, l_ptr,
                     H, R, DR, bt_stride, page, num_splits, scale,
                     BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_DR: tl.constexpr, PRECISION: tl.constexpr):
    """One query token, BLOCK_H heads, one of num_splits parts of its context: online
    softmax over the part's keys (latent . q_lat + k_pe . q_pe), and the unnormalised sum of
    p * latent with its running max and denominator, for the splits' merge."""
    t, hb, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq = tl.load(seq_ptr + t)
    last = tl.load(last_ptr + t)  # the query's own position: it sees keys 0..last
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    rs = tl.arange(0, BLOCK_R)
    ds = tl.arange(0, BLOCK_DR)
    q_lat = tl.load(q_lat_ptr + (t * H + heads)[:, None] * R + rs[None, :],
                    mask=h_ok[:, None] & (rs < R)[None, :], other=0.0)
    q_pe = tl.load(q_pe_ptr + (t * H + heads)[:, None] * DR + ds[None, :],
                   mask=h_ok[:, None] & (ds < DR)[None, :], other=0.0)
    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_R), dtype=tl.float32)
    # the token's own context in num_splits equal parts (whole key blocks): a short context
    # in a long table still spreads over every split
    per = (tl.cdiv(last + 1, num_splits) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = s * per
    stop = tl.minimum(start + per, last + 1)
    for j0 in range(start, stop, BLOCK_N):
        js = j0 + tl.arange(0, BLOCK_N)
        j_ok = js < stop
        blk = tl.load(block_table_ptr + seq * bt_stride + js // page, mask=j_ok, other=0)
        row = (blk * page + js % page).to(tl.int64) * (R + DR)
        lat = tl.load(kv_ptr + row[:, None] + rs[None, :],
                      mask=j_ok[:, None] & (rs < R)[None, :], other=0.0)
        kpe = tl.load(kv_ptr + row[:, None] + R + ds[None, :],
                      mask=j_ok[:, None] & (ds < DR)[None, :], other=0.0)
        scores = tl.dot(q_lat, tl.trans(lat), input_precision=PRECISION)
        scores = tl.dot(q_pe, tl.trans(kpe), scores, input_precision=PRECISION) * scale
        scores = tl.where(j_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(lat.dtype), lat, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    part = ((t * num_splits + s) * H + heads).to(tl.int64)  # T * S * H * R may pass 2^31
    tl.store(o_ptr + part[:, None] * R + rs[None, :], acc,
             mask=h_ok[:, None] & (rs < R)[None, :])
    tl.store(m_ptr + part, m_i, mask=h_ok)
    tl.store(l_ptr + part, l_i, mask=h_ok)
