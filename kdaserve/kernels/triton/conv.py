"""KDA's causal short conv in Triton (`short_conv_ref`'s contract): any number of new tokens
per sequence, continuing from and updating each slot's conv state.

Every output token is independent given its inputs (the previous W-1 pre-conv rows: from this
call's tokens, or from the slot's state before the first of them), so one program computes a
token's channel block; a second launch then rolls each slot's state forward. Two launches,
because a token reading a slot's old state must not race the write of its new one.

Triton is imported on the first call (`_kernels`), never at import.
"""

from __future__ import annotations

from typing import Any

import torch

from kdaserve.kernels.ref.kda import short_conv_ref
from kdaserve.kernels.triton import jit_module, tile

BLOCK_D = 128


def _kernels() -> Any:
    return jit_module("conv_kernels")


def short_conv_triton(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                      state_slots: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """x: [T, D] pre-conv rows; weight: [D, W]; conv_state: [N, W-1, D] pool; state_slots [B];
    cu_seqlens [B+1]. Returns SiLU(conv) [T, D] in x.dtype, summed in fp32."""
    T, D = x.shape
    W = weight.shape[1]
    if T == 0:
        return torch.empty_like(x)
    if not conv_state.is_contiguous():  # the kernels index the pool as [N, W-1, D] rows
        return short_conv_ref(x, weight, conv_state, state_slots, cu_seqlens)
    k = _kernels()
    dev = x.device
    x = x.contiguous()
    cu = cu_seqlens.to(dev, torch.int64)
    slots = state_slots.to(dev, torch.int64).contiguous()
    tok = torch.arange(T, device=dev)
    seq = torch.searchsorted(cu[1:], tok, right=True)
    starts = cu[:-1].contiguous()
    out = torch.empty_like(x)
    grid_d = -(-D // BLOCK_D)
    k.conv_kernel[(T, grid_d)](x, weight.contiguous(), conv_state, seq, tok - cu[seq], slots,
                               starts, out, D, W=W, BLOCK_W=tile(W, least=2), BLOCK_D=BLOCK_D)
    k.state_kernel[(slots.numel(), grid_d)](
        x, conv_state, slots, starts, (cu[1:] - starts).contiguous(), D, W=W,
        BLOCK_W=tile(W - 1, least=2), BLOCK_D=BLOCK_D)
    return out
