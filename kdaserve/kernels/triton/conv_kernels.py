"""The KDA short conv's Triton kernels (`kdaserve/kernels/triton/conv.py` launches them). This
module imports triton at import: only `conv._kernels` imports it, on the first call."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def conv_taps(w_ptr, ch, ok, W: tl.constexpr, BLOCK_W: tl.constexpr):
    """The conv weights of channels `ch` as a [BLOCK_W, len(ch)] fp32 tile (tap j in row j,
    rows past W zero): loaded once, where a loop convolves several tokens with them."""
    j = tl.arange(0, BLOCK_W)
    return tl.load(w_ptr + ch[None, :] * W + j[:, None], mask=(j < W)[:, None] & ok[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def conv_at(x_ptr, taps, state_ptr, slot, start, pos, ch, ok, D, W: tl.constexpr,
            BLOCK_W: tl.constexpr):
    """SiLU(sum_j taps[j] * input at pos - (W-1) + j) for channels `ch` of a sequence's
    token `pos` (within this call's tokens, which start at row `start`), in fp32; the inputs
    before its first new token are read from its slot's conv state."""
    j = tl.arange(0, BLOCK_W)
    p = pos - (W - 1) + j
    m = (j < W)[:, None] & ok[None, :]
    from_x = (p >= 0)[:, None]
    # two masked loads, each lane from one of them: the pool may keep another dtype than x
    x = tl.load(x_ptr + ((start + p) * D)[:, None] + ch[None, :], mask=m & from_x,
                other=0.0).to(tl.float32)
    x += tl.load(state_ptr + ((slot * (W - 1) + (W - 1) + p) * D)[:, None] + ch[None, :],
                 mask=m & ~from_x, other=0.0).to(tl.float32)
    acc = tl.sum(x * taps, 0)
    return acc / (1.0 + tl.exp(-acc))


@triton.jit
def next_conv_state(x_ptr, state_ptr, slot, start, n, ch, ok, D, W: tl.constexpr,
                    BLOCK_W: tl.constexpr):
    """A slot's next conv state for channels `ch`, [BLOCK_W, len(ch)] (rows past W-1
    unused): the last W-1 rows of [old state ; its n new inputs]. The caller stores it after
    a barrier, as row r takes what row n + r held."""
    rows = tl.arange(0, BLOCK_W)
    idx = n + rows  # in [old state ; new inputs]
    m = (rows < W - 1)[:, None] & ok[None, :]
    from_state = (idx < W - 1)[:, None]
    old = tl.load(state_ptr + (slot * (W - 1) + idx)[:, None] * D + ch[None, :],
                  mask=m & from_state, other=0.0)
    new = tl.load(x_ptr + (start + idx - (W - 1))[:, None] * D + ch[None, :],
                  mask=m & ~from_state, other=0.0)
    return tl.where(from_state, old, new.to(old.dtype))


@triton.jit
def conv_kernel(x_ptr, w_ptr, state_ptr, seq_ptr, pos_ptr, slot_ptr, start_ptr, out_ptr, D,
                W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token, BLOCK_D channels."""
    t = tl.program_id(0)
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = ds < D
    seq = tl.load(seq_ptr + t)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    y = conv_at(x_ptr, conv_taps(w_ptr, ds, d_ok, W, BLOCK_W), state_ptr, slot,
                tl.load(start_ptr + seq), tl.load(pos_ptr + t), ds, d_ok, D, W, BLOCK_W)
    tl.store(out_ptr + t * D + ds, y.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def state_kernel(x_ptr, state_ptr, slot_ptr, start_ptr, count_ptr, D,
                 W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr):
    """One sequence, BLOCK_D channels: its conv state rolled past its new inputs."""
    b = tl.program_id(0)
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = ds < D
    slot = tl.load(slot_ptr + b).to(tl.int64)
    rows = tl.arange(0, BLOCK_W)
    nxt = next_conv_state(x_ptr, state_ptr, slot, tl.load(start_ptr + b), tl.load(count_ptr + b),
                          ds, d_ok, D, W, BLOCK_W)
    # threads own different rows, so every read must land before any write (Triton orders
    # only shared memory by itself)
    tl.debug_barrier()
    tl.store(state_ptr + (slot * (W - 1) + rows)[:, None] * D + ds[None, :], nxt,
             mask=(rows < W - 1)[:, None] & d_ok[None, :])
