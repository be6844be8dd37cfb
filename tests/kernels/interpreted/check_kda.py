"""Run by tests/kernels/test_triton_interpreted.py under Triton's interpreter: the fused KDA
decode kernel (conv, activations, delta rule, gated norm in one launch) against
`kda_decode_ref`, for one token per sequence and for a few (verifies, shorter and longer
than the conv window), on scattered slots, with head sizes that are not powers of two; the
pools' other slots untouched."""

from __future__ import annotations

import pytest
import torch

from kdaserve.kernels.ref.kda import kda_decode_ref
from kdaserve.kernels.triton.kda import kda_decode_fused, kda_decode_triton


def case(lengths: list[int] | None, B: int, H: int, K: int, V: int, W: int,
         dtype: torch.dtype, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    T = B if lengths is None else sum(lengths)
    D, N = 2 * H * K + H * V, B + 4
    x = (torch.randn(T, D, generator=g) * 2).to(dtype)
    f = torch.randn(T, H, K, generator=g).to(dtype)
    beta = torch.randn(T, H, generator=g).to(dtype)
    z = torch.randn(T, H, V, generator=g).to(dtype)
    conv_w = (torch.randn(D, W, generator=g) / W).to(dtype)
    A_log = torch.randn(H, generator=g)
    dt_bias = torch.randn(H * K, generator=g)
    norm_w = torch.randn(V, generator=g).to(dtype)
    state = torch.randn(N, H, K, V, generator=g) * 0.3
    conv = torch.randn(N, W - 1, D, generator=g).to(dtype)
    slots = torch.randperm(N, generator=g)[:B]
    cu = None if lengths is None else torch.tensor([0, *lengths]).cumsum(0)
    return x, f, beta, z, conv_w, A_log, dt_bias, norm_w, 1e-5, state, conv, slots, cu


@pytest.mark.parametrize("lengths,B,H,K,V,W", [
    (None, 3, 2, 16, 16, 4),  # one token each
    (None, 2, 3, 12, 20, 4),  # heads not powers of two
    ([1, 3, 2, 5], 4, 2, 8, 16, 4),  # verifies: within and past the window
    ([2, 1], 2, 1, 16, 8, 2),
])
def test_fused_decode_matches_reference(lengths: list[int] | None, B: int, H: int, K: int,
                                        V: int, W: int) -> None:
    args = case(lengths, B, H, K, V, W, torch.float32, seed=B * 100 + K + V + W)
    *head, state, conv, slots, cu = args
    want_state, want_conv = state.clone(), conv.clone()
    want = kda_decode_ref(*head, want_state, want_conv, slots, cu)
    got = kda_decode_fused(*head, state, conv, slots, cu)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-4)
    torch.testing.assert_close(state, want_state, atol=2e-5, rtol=2e-4)
    assert torch.equal(conv, want_conv)  # rolled, and every other slot as it was
    others = [s for s in range(state.shape[0]) if s not in slots.tolist()]
    assert torch.equal(state[others], want_state[others])


def test_fused_decode_bf16_and_the_backend_entry() -> None:
    """bf16 activations (fp32 state): within bf16 rounding of the reference; and the triton
    backend's kda_decode takes the fused kernel (fla is not needed for it)."""
    args = case(None, 3, 2, 16, 32, 4, torch.bfloat16, seed=5)
    *head, state, conv, slots, cu = args
    want_state, want_conv = state.clone(), conv.clone()
    want = kda_decode_ref(*head, want_state, want_conv, slots, cu)
    got = kda_decode_triton(*head, state, conv, slots, cu)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    # a conv output one bf16 step apart (exp rounds differently) moves the state by ~1e-3
    torch.testing.assert_close(state, want_state, atol=1e-2, rtol=1e-2)
    assert torch.equal(conv, want_conv)
