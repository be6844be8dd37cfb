"""The KDA short conv's Triton kernels (`kdaserve/kernels/triton/conv.py` launches them). This
module imports triton at import: only `conv._kernels` imports it, on the first call."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def conv_kernel(x_ptr, w_ptr, state_ptr, seq_ptr, pos_ptr, slot_ptr, start_ptr, out_ptr, D,
                W: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token, BLOCK_D channels: SiLU(sum_j w[:, j] * input at pos - (W-1) + j), the
    inputs before the sequence's first new token read from its slot's conv state."""
    t = tl.program_id(0)
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = ds < D
    seq = tl.load(seq_ptr + t)
    pos = tl.load(pos_ptr + t)  # within this call's tokens of the sequence
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    start = tl.load(start_ptr + seq)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(W):
        p = pos - (W - 1) + j
        if p >= 0:  # both branches fp32: the pool may keep another dtype than x
            v = tl.load(x_ptr + (start + p) * D + ds, mask=d_ok, other=0.0).to(tl.float32)
        else:
            v = tl.load(state_ptr + (slot * (W - 1) + (W - 1) + p) * D + ds, mask=d_ok,
                        other=0.0).to(tl.float32)
        acc += v * tl.load(w_ptr + ds * W + j, mask=d_ok, other=0.0).to(tl.float32)
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + t * D + ds, y.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def state_kernel(x_ptr, state_ptr, slot_ptr, start_ptr, count_ptr, D,
                 W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr):
    """One sequence, BLOCK_D channels: its conv state becomes the last W-1 rows of
    [old state ; its new inputs], all read before any is written."""
    b = tl.program_id(0)
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    start = tl.load(start_ptr + b)
    n = tl.load(count_ptr + b)
    rows = tl.arange(0, BLOCK_W)
    idx = n + rows  # in [old state ; new inputs]
    ok = (rows < W - 1)[:, None] & (ds < D)[None, :]
    from_state = (idx < W - 1)[:, None]
    old = tl.load(state_ptr + (slot * (W - 1) + idx)[:, None] * D + ds[None, :],
                  mask=ok & from_state, other=0.0)
    new = tl.load(x_ptr + (start + idx - (W - 1))[:, None] * D + ds[None, :],
                  mask=ok & ~from_state, other=0.0)
    # row r is written with what row n + r held: threads own different rows, so every read
    # must land before any write (Triton orders only shared memory by itself)
    tl.debug_barrier()
    tl.store(state_ptr + (slot * (W - 1) + rows)[:, None] * D + ds[None, :],
             tl.where(from_state, old, new.to(old.dtype)), mask=ok)
