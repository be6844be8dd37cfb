"""The `batch_invariant` kernels (deterministic inference): each equals its plain-torch
reference (closeness) and gives bit-identical rows whatever else is in the call, wherever a
row sits, and however a sequence is split into calls (equality, not closeness)."""

from __future__ import annotations

import pytest
import torch

from kdaserve.kernels import (
    BATCH_INVARIANT,
    OPS,
    linear_ref,
    registry,
    resolve_kernels,
    rms_norm_ref,
    silu_mul_ref,
)
from kdaserve.kernels.native import batch_invariant as bi
from kdaserve.kernels.ref.attn_res import attn_res_norm_ref
from kdaserve.kernels.ref.kda import gated_rmsnorm, kda_chunk_ref, short_conv_ref
from kdaserve.kernels.ref.mla import mla_attention_ref
from kdaserve.kernels.ref.mlp import situ_mul_ref
from kdaserve.kernels.ref.moe import moe_experts_ref, moe_route_ref
from kdaserve.kernels.ref.mxfp4 import dequantize_mxfp4

CPU = torch.device("cpu")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed)) * scale


def test_deterministic_resolution_takes_every_op_from_the_backend() -> None:
    kernels = resolve_kernels(CPU, deterministic=True)
    names = {b.fn: b.name for op in OPS for b in registry.backends(op)}
    assert all(names[getattr(kernels, op)] == BATCH_INVARIANT for op in OPS)
    # and the backend is never picked by priority
    plain = resolve_kernels(CPU)
    assert all(names[getattr(plain, op)] != BATCH_INVARIANT for op in OPS)
    registry.register("only_ref_op", "ref", linear_ref)
    with pytest.raises(ValueError, match="no 'batch_invariant' kernel"):
        registry.resolve("only_ref_op", CPU, BATCH_INVARIANT, strict=True)
    with pytest.raises(ValueError, match="CPU"):
        bi.linear_bi(rand(2, 8, seed=0).double(), rand(4, 8, seed=1).double())


def _bank(a: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    return a[:, :2 * K].reshape(-1, 2, K).transpose(0, 1), a[:, 2 * K:]


@pytest.mark.parametrize("K", [7, 16, 130])
def test_row_ops_match_reference_and_do_not_depend_on_the_batch(K: int) -> None:
    M = 37
    x, w = rand(M, K, seed=1), rand(45, K, seed=2)
    nw, z = rand(K, seed=3), rand(M, K, seed=4)
    gu = rand(M, 2 * K, seed=5)
    cases = [
        (lambda a: bi.linear_bi(a, w), lambda a: linear_ref(a, w), x),
        (lambda a: bi.rms_norm_bi(a, nw, 1e-6), lambda a: rms_norm_ref(a, nw, 1e-6), x),
        (lambda a: bi.gated_rmsnorm_bi(a[:, :K], a[:, K:], nw, 1e-5),
         lambda a: gated_rmsnorm(a[:, :K], a[:, K:], nw, 1e-5), torch.cat([x, z], 1)),
        (bi.silu_mul_bi, silu_mul_ref, gu),
        (bi.sigmoid_bi, torch.sigmoid, x),
        (lambda a: bi.situ_mul_bi(a * 8, 4.0, 25.0), lambda a: situ_mul_ref(a * 8, 4.0, 25.0),
         gu),
        # K3's mix + norm: each row holds its two bank sources, then its partial sum
        (lambda a: bi.attn_res_norm_bi(*_bank(a, K), nw, 1e-5, z[0], 1e-6),
         lambda a: attn_res_norm_ref(*_bank(a, K), nw, 1e-5, z[0], 1e-6),
         torch.cat([x, z, x * 2], 1)),
    ]
    for fast, ref, a in cases:
        full = fast(a)
        torch.testing.assert_close(full, ref(a), atol=2e-5, rtol=1e-5)
        for lo, hi in [(0, 1), (5, 6), (3, 7), (10, 33), (36, 37)]:
            assert torch.equal(fast(a[lo:hi]), full[lo:hi])
        # a row among other rows than its own batch's: same bits
        mixed = torch.cat([rand(3, a.shape[1], seed=9), a[20:21], rand(8, a.shape[1], seed=10)])
        assert torch.equal(fast(mixed)[3], full[20])


def conv_inputs(seed: int, C: int = 24, W: int = 4, N: int = 6):
    return rand(C, W, seed=seed), rand(N, W - 1, C, seed=seed + 1)


def test_short_conv_matches_reference_and_any_split() -> None:
    C, lens = 24, [5, 1, 17]
    w, pool = conv_inputs(11)
    x = rand(sum(lens), C, seed=12)
    slots = torch.tensor([4, 0, 2])
    cu = torch.tensor([0, 5, 6, 23])
    p_ref, p_bi = pool.clone(), pool.clone()
    out = bi.short_conv_bi(x, w, p_bi, slots, cu)
    torch.testing.assert_close(out, short_conv_ref(x, w, p_ref, slots, cu), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(p_bi, p_ref)
    # the third sequence alone, token by token: same output rows and final window, to the bit
    p_one = pool.clone()
    rows = [bi.short_conv_bi(x[t:t + 1], w, p_one, slots[2:], torch.tensor([0, 1]))
            for t in range(6, 23)]
    assert torch.equal(torch.cat(rows), out[6:23])
    assert torch.equal(p_one[2], p_bi[2])


def kda_inputs(T: int, H: int = 2, K: int = 16, seed: int = 20):
    return {"q": rand(T, H, K, seed=seed), "k": rand(T, H, K, seed=seed + 1),
                "v": rand(T, H, K, seed=seed + 2), "g": rand(T, H, K, seed=seed + 3),
                "beta": rand(T, H, seed=seed + 4), "A_log": rand(H, seed=seed + 5, scale=0.5),
                "dt_bias": rand(H * K, seed=seed + 6, scale=0.5)}


def test_kda_scan_matches_reference_and_any_chunking() -> None:
    lens, H, K = [9, 30], 2, 16
    a = kda_inputs(sum(lens), H, K)
    state0 = rand(5, H, K, K, seed=30, scale=0.1)
    slots, cu = torch.tensor([3, 1]), torch.tensor([0, 9, 39])
    s_ref, s_bi = state0.clone(), state0.clone()
    out = bi.kda_chunk_bi(**a, state=s_bi, state_slots=slots, cu_seqlens=cu)
    ref = kda_chunk_ref(**a, state=s_ref, state_slots=slots, cu_seqlens=cu)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s_bi, s_ref, atol=1e-4, rtol=1e-4)
    # the second sequence in chunks of 7, 1, 16, 6: same bits
    s_split, pieces, t = state0.clone(), [], 9
    for n in (7, 1, 16, 6):
        part = {key: (val[t:t + n] if val.shape[0] == 39 else val) for key, val in a.items()}
        pieces.append(bi.kda_chunk_bi(**part, state=s_split, state_slots=slots[1:],
                                      cu_seqlens=torch.tensor([0, n])))
        t += n
    assert torch.equal(torch.cat(pieces), out[9:])
    assert torch.equal(s_split[1], s_bi[1])


def test_kda_decode_is_the_prefill_path_token_by_token() -> None:
    T, H, K, W = 6, 2, 16, 4
    a = kda_inputs(T, H, K, seed=40)
    qkv = rand(T, 3 * H * K, seed=41)
    conv_w, conv0 = conv_inputs(42, C=3 * H * K, W=W, N=3)
    z, nw = rand(T, H, K, seed=43), rand(K, seed=44)
    state0 = rand(3, H, K, K, seed=45, scale=0.1)
    slot, cu = torch.tensor([2]), torch.tensor([0, T])
    # prefill path as KDAttention runs it
    s1, c1 = state0.clone(), conv0.clone()
    x = bi.short_conv_bi(qkv, conv_w, c1, slot, cu)
    q, k, v = (t.view(T, H, K) for t in x.chunk(3, dim=-1))
    o = bi.kda_chunk_bi(q, k, v, a["g"], a["beta"], a["A_log"], a["dt_bias"], s1, slot, cu)
    prefill = bi.gated_rmsnorm_bi(o, z, nw, 1e-5)
    s2, c2 = state0.clone(), conv0.clone()
    steps = [bi.kda_decode_bi(qkv[t:t + 1], a["g"][t:t + 1], a["beta"][t:t + 1], z[t:t + 1],
                              conv_w, a["A_log"], a["dt_bias"], nw, 1e-5, s2, c2, slot)
             for t in range(T)]
    assert torch.equal(torch.cat(steps), prefill)
    assert torch.equal(s1, s2) and torch.equal(c1, c2)


def mla_setup(ctx: list[int], seed: int, H: int = 2, Dn: int = 8, Dr: int = 4, R: int = 20,
              Dv: int = 6, BS: int = 4):
    NB = sum(-(-c // BS) for c in ctx) + 2
    cache = rand(NB, BS, R + Dr, seed=seed)
    perm = torch.randperm(NB, generator=gen(seed + 1)).tolist()
    M = max(-(-c // BS) for c in ctx)
    table = torch.zeros(len(ctx), M, dtype=torch.int64)
    for b, c in enumerate(ctx):
        n = -(-c // BS)
        table[b, :n] = torch.tensor([perm.pop() for _ in range(n)])
    kv_b = rand(H, Dn + Dv, R, seed=seed + 2, scale=0.3)
    return cache, table, kv_b[:, :Dn], kv_b[:, Dn:]


def test_mla_prefill_rows_equal_decode_rows() -> None:
    ctx, new = [13, 6, 21], [5, 6, 1]
    H, Dn, Dr = 2, 8, 4
    cache, table, w_uk, w_uv = mla_setup(ctx, 50, H, Dn, Dr)
    T = sum(new)
    qn, qp = rand(T, H, Dn, seed=51), rand(T, H, Dr, seed=52)
    cu = torch.tensor([0, 5, 11, 12])
    lens = torch.tensor(ctx)
    out = bi.mla_attention_bi(qn, qp, cache, table, cu, lens, w_uk, w_uv, 0.3)
    ref = mla_attention_ref(qn, qp, cache, table, cu, lens, w_uk, w_uv, 0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # each row of sequence 0 as a decode step (one query, the context up to it), alone
    for i in range(5):
        row = bi.mla_attention_bi(qn[i:i + 1], qp[i:i + 1], cache, table[:1],
                                  torch.tensor([0, 1]), torch.tensor([ctx[0] - 5 + i + 1]),
                                  w_uk, w_uv, 0.3)
        assert torch.equal(row, out[i:i + 1])


def test_moe_matches_reference_and_does_not_depend_on_the_batch() -> None:
    T, D, E, inter, k = 40, 24, 6, 20, 3
    x = rand(T, D, seed=60)
    logits = rand(T, E, seed=61)
    bias = rand(E, seed=62, scale=0.1)
    w13, w2 = rand(E, 2 * inter, D, seed=63, scale=0.2), rand(E, D, inter, seed=64, scale=0.2)
    args = (bias, k, 2, 1, True, 2.5, "sigmoid")
    weights, ids = bi.moe_route_bi(logits, *args)
    rw, rids = moe_route_ref(logits, *args)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(weights, rw, atol=1e-6, rtol=1e-6)
    out = bi.moe_experts_bi(x, weights, ids, w13, w2)
    torch.testing.assert_close(out, moe_experts_ref(x, weights, ids, w13, w2), atol=1e-5,
                               rtol=1e-5)
    for lo, hi in [(0, 1), (7, 8), (3, 19), (39, 40)]:
        w_part, i_part = bi.moe_route_bi(logits[lo:hi], *args)
        assert torch.equal(w_part, weights[lo:hi]) and torch.equal(i_part, ids[lo:hi])
        assert torch.equal(bi.moe_experts_bi(x[lo:hi], w_part, i_part, w13, w2), out[lo:hi])


@pytest.mark.parametrize("situ", [None, (4.0, 8.0)])
def test_moe_with_mxfp4_experts_is_the_dequantized_one_bit_for_bit(situ) -> None:  # noqa: ANN001
    """MXFP4 experts (uint8 codes, E8M0 scales) decoded row by row inside the kernel give the
    bits of fp32 experts holding the dequantized weights, at any batch: deterministic
    inference serves K3's released experts as they ship. Inputs 64 / 96 wide (two and three
    scale groups), every code and a wide range of scales."""
    T, D, E, inter, k = 23, 96, 5, 64, 2
    g = torch.Generator().manual_seed(70)
    w13 = torch.randint(0, 256, (E, 2 * inter, D // 2), generator=g, dtype=torch.uint8)
    w2 = torch.randint(0, 256, (E, D, inter // 2), generator=g, dtype=torch.uint8)
    s13 = torch.randint(117, 130, (E, 2 * inter, D // 32), generator=g, dtype=torch.uint8)
    s2 = torch.randint(117, 130, (E, D, inter // 32), generator=g, dtype=torch.uint8)
    s13[0, 0, 0], s2[1, 2, 0] = 0, 1  # the subnormal end of E8M0
    x = rand(T, D, seed=71)
    weights, ids = bi.moe_route_bi(rand(T, E, seed=72), None, k, 1, 1, True, 1.0, "softmax")
    out = bi.moe_experts_bi(x, weights, ids, w13, w2, s13, s2, situ=situ)
    plain = bi.moe_experts_bi(x, weights, ids, dequantize_mxfp4(w13, s13),
                              dequantize_mxfp4(w2, s2), situ=situ)
    assert torch.equal(out, plain) and out.abs().sum() > 0
    for lo, hi in [(0, 1), (5, 6), (2, 17), (22, 23)]:
        assert torch.equal(bi.moe_experts_bi(x[lo:hi], weights[lo:hi], ids[lo:hi], w13, w2,
                                             s13, s2, situ=situ), out[lo:hi])
    with pytest.raises(ValueError, match="E8M0 scales"):
        bi.moe_experts_bi(x, weights, ids, w13, w2)
