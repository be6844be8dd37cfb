"""K3's SiTU-GLU and Attention Residuals mix + RMSNorm as Triton ops (`k3_kernels.py`), behind
`situ_mul_ref`'s and `attn_res_norm_ref`'s contracts."""

from __future__ import annotations

from typing import Any

import torch

from kdaserve.kernels.triton import jit_module, tile


def _kernels() -> Any:
    return jit_module("k3_kernels")


def situ_mul_triton(gate_up: torch.Tensor, beta: float,
                    linear_beta: float | None) -> torch.Tensor:
    x = gate_up.contiguous()
    inter = x.shape[-1] // 2
    y = x.new_empty(*x.shape[:-1], inter)
    rows = x.numel() // (2 * inter) if inter else 0
    if rows:
        block = tile(inter, most=1024)
        _kernels().situ_mul_kernel[(rows, -(-inter // block))](
            x, y, inter, beta, linear_beta or 1.0, CAP_UP=linear_beta is not None, BLOCK=block)
    return y


def attn_res_norm_triton(bank: torch.Tensor, partial: torch.Tensor, w_eff: torch.Tensor,
                         eps: float, norm_weight: torch.Tensor,
                         norm_eps: float) -> torch.Tensor:
    """One program per token (its sources are a few rows of D: K3's 7168 x at most 9)."""
    NB, (T, D) = bank.shape[0], partial.shape
    out = torch.empty_like(partial)
    if T:
        partial = partial.contiguous()
        _kernels().attn_res_norm_kernel[(T,)](
            bank.contiguous() if NB else partial, partial, w_eff.contiguous(),
            norm_weight.contiguous(), out, NB, T, D, eps, norm_eps,
            BLOCK_D=tile(D, most=1024), BLOCK_S=tile(NB + 1, least=2))
    return out
