"""Run by tests/kernels/test_triton_interpreted.py under Triton's interpreter: K3's Triton
work against the plain-torch references: the fused KDA decode with the lower-bounded gate,
SiTU-GLU alone and inside the fused MoE, and the AttnRes mix + RMSNorm
(no bank, one source, several; D past one tile)."""

from __future__ import annotations

import pytest
import torch

from kdaserve.kernels.ref.attn_res import attn_res_norm_ref
from kdaserve.kernels.ref.kda import kda_decode_ref
from kdaserve.kernels.ref.mlp import situ_mul_ref
from kdaserve.kernels.ref.moe import moe_experts_ref
from kdaserve.kernels.triton.k3 import attn_res_norm_triton, situ_mul_triton
from kdaserve.kernels.triton.kda import kda_decode_fused
from kdaserve.kernels.triton.moe import moe_experts_triton

BOUND = -5.0  # K3's gate_lower_bound


@pytest.mark.parametrize("lengths", [None, [1, 3, 2]], ids=["decode", "verify"])
def test_fused_decode_with_lower_bound(lengths: list[int] | None) -> None:
    g = torch.Generator().manual_seed(4)
    B, H, K, V, W = 3, 2, 12, 16, 4
    T = B if lengths is None else sum(lengths)
    D, N = 2 * H * K + H * V, B + 2
    x, f = torch.randn(T, D, generator=g) * 2, torch.randn(T, H, K, generator=g) * 3
    beta, z = torch.randn(T, H, generator=g), torch.randn(T, H, V, generator=g)
    conv_w = torch.randn(D, W, generator=g) / W
    A_log, dt_bias = torch.rand(H, generator=g) * 2, torch.randn(H * K, generator=g)
    norm_w = torch.randn(V, generator=g)
    state, conv = torch.randn(N, H, K, V, generator=g) * 0.3, torch.randn(N, W - 1, D, generator=g)
    slots = torch.tensor([4, 0, 2])
    cu = None if lengths is None else torch.tensor([0, *lengths]).cumsum(0)
    head = (x, f, beta, z, conv_w, A_log, dt_bias, norm_w, 1e-5)
    want_state, want_conv = state.clone(), conv.clone()
    want = kda_decode_ref(*head, want_state, want_conv, slots, cu, lower_bound=BOUND)
    got = kda_decode_fused(*head, state, conv, slots, cu, lower_bound=BOUND)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-4)
    torch.testing.assert_close(state, want_state, atol=2e-5, rtol=2e-4)
    assert torch.equal(conv, want_conv)
    # the plain gate on the same inputs differs: the bound reached the kernel
    plain = kda_decode_ref(*head, state.clone(), conv.clone(), slots, cu)
    assert not torch.allclose(plain, want, atol=1e-3)


@pytest.mark.parametrize("linear_beta", [25.0, None])
def test_situ_mul(linear_beta: float | None) -> None:
    gu = torch.randn(5, 2 * 37, generator=torch.Generator().manual_seed(1)) * 30
    torch.testing.assert_close(situ_mul_triton(gu, 4.0, linear_beta),
                               situ_mul_ref(gu, 4.0, linear_beta), atol=2e-5, rtol=1e-5)


# fp32 only: the interpreter's bf16 tl.dot gives garbage (SwiGLU experts too, ~1e10 off),
# so bf16 experts are checked compiled on a GPU (tests/kernels/compiled/)
@pytest.mark.parametrize("dtype", [torch.float32])
@pytest.mark.parametrize("linear_beta", [25.0, None])
def test_fused_moe_with_situ(dtype: torch.dtype, linear_beta: float | None) -> None:
    g = torch.Generator().manual_seed(7)
    T, D, inter, E, k = 9, 32, 24, 5, 2
    x = (torch.randn(T, D, generator=g) * 2).to(dtype)
    w13 = torch.randn(E, 2 * inter, D, generator=g).to(dtype)  # large: the caps are reached
    w2 = (torch.randn(E, D, inter, generator=g) / inter ** 0.5).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    want = moe_experts_ref(x, weights, ids, w13, w2, situ=(4.0, linear_beta))
    got = moe_experts_triton(x, weights, ids, w13, w2, situ=(4.0, linear_beta))
    assert got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2 * want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=1e-2)
    silu = moe_experts_ref(x, weights, ids, w13, w2)
    assert not torch.allclose(got.float(), silu.float(), atol=tol)  # SiTU, not SiLU


@pytest.mark.parametrize("num_blocks,D", [(0, 40), (1, 40), (8, 77), (3, 1500)])
def test_attn_res_norm(num_blocks: int, D: int) -> None:
    g = torch.Generator().manual_seed(num_blocks + D)
    T = 5
    bank = torch.randn(num_blocks, T, D, generator=g) * 4
    partial, w_eff = torch.randn(T, D, generator=g), torch.randn(D, generator=g) * 3
    norm_w = 1 + 0.1 * torch.randn(D, generator=g)
    want = attn_res_norm_ref(bank, partial, w_eff, 1e-5, norm_w, 1e-6)
    got = attn_res_norm_triton(bank, partial, w_eff, 1e-5, norm_w, 1e-6)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
