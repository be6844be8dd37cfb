"""The cpu decode backends against the reference on decode batches (one new token per
sequence, random state slots and block tables, ragged contexts), and their fallbacks."""

from __future__ import annotations

import pytest
import torch

from kdaserve.kernels.cpu.decode import kda_recurrent_cpu, mla_attention_cpu, short_conv_cpu
from kdaserve.kernels.ref.kda import kda_recurrent_ref, short_conv_ref
from kdaserve.kernels.ref.mla import mla_attention_ref


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("B", [1, 9])
def test_kda_recurrent_decode_batch(B: int) -> None:
    H, K, N = 3, 16, 12
    g = gen(B)
    q, k, v, f = (torch.randn(B, H, K, generator=g) for _ in range(4))
    beta, A_log, dt = torch.randn(B, H, generator=g), torch.rand(H, generator=g), \
        torch.randn(H * K, generator=g)
    pool = torch.randn(N, H, K, K, generator=g)
    slots = torch.randperm(N, generator=g)[:B]
    cu = torch.arange(B + 1)
    ref_pool = pool.clone()
    o_ref = kda_recurrent_ref(q, k, v, f, beta, A_log, dt, ref_pool, slots, cu)
    o = kda_recurrent_cpu(q, k, v, f, beta, A_log, dt, pool, slots, cu)
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(pool, ref_pool, atol=2e-5, rtol=1e-4)  # other slots untouched


@pytest.mark.parametrize("lengths", [[1, 1, 1], [2, 1, 5]], ids=["decode", "mixed"])
def test_short_conv_decode_batch_and_fallback(lengths: list[int]) -> None:
    D, W, N = 10, 4, 6
    g = gen(len(lengths))
    x = torch.randn(sum(lengths), D, generator=g)
    w = torch.randn(D, W, generator=g)
    state = torch.randn(N, W - 1, D, generator=g)
    slots = torch.tensor([4, 0, 2])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    ref_state = state.clone()
    y_ref = short_conv_ref(x, w, ref_state, slots, cu)
    y = short_conv_cpu(x, w, state, slots, cu)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(state, ref_state)


@pytest.mark.parametrize("block_size", [1, 4])
def test_mla_decode_batch(block_size: int) -> None:
    H, Dn, Dr, Dv, R = 2, 8, 4, 8, 12
    ctx = [1, 7, 13, 4, 9]
    B = len(ctx)
    g = gen(block_size)
    nb = sum(-(-c // block_size) for c in ctx) + 3
    cache = torch.randn(nb, block_size, R + Dr, generator=g)
    order = torch.randperm(nb, generator=g).tolist()
    _tables, start = [], 0
    width = max(-(-c // block_size) for c in ctx)
    table = torch.zeros(B, width, dtype=torch.int64)
    for b, c in enumerate(ctx):
        n = -(-c // block_size)
        table[b, :n] = torch.tensor(order[start:start + n])
        start += n
    q_nope, q_pe = torch.randn(B, H, Dn, generator=g), torch.randn(B, H, Dr, generator=g)
    w_uk, w_uv = torch.randn(H, Dn, R, generator=g), torch.randn(H, Dv, R, generator=g)
    args = (q_nope, q_pe, cache, table, torch.arange(B + 1), torch.tensor(ctx), w_uk, w_uv, 0.3)
    torch.testing.assert_close(mla_attention_cpu(*args), mla_attention_ref(*args),
                               atol=1e-5, rtol=1e-4)
