"""The C++ `native` decode kernels against the plain-torch references: random state slots and
block tables, initial states, ragged contexts of 1..200 tokens, several consecutive steps (so
the conv window shift is checked too), and the fallbacks for what they do not handle."""

from __future__ import annotations

import pytest
import torch

from kdaserve.kernels import resolve_kernels
from kdaserve.kernels.cpu.decode import kda_decode_cpu, mla_attention_cpu
from kdaserve.kernels.native import batch_invariant as bi
from kdaserve.kernels.native import build
from kdaserve.kernels.native import ops as native_ops
from kdaserve.kernels.native.ops import (
    VERIFY_MAX_TOKENS,
    kda_chunk_native,
    kda_decode_native,
    mla_attention_native,
    moe_experts_native,
    moe_route_native,
    short_conv_native,
    silu_mul_native,
)
from kdaserve.kernels.ref.kda import kda_chunk_ref, kda_decode_ref, short_conv_ref
from kdaserve.kernels.ref.mla import mla_attention_ref

W = 4


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_native_library_builds_here() -> None:
    ok, reason = build.available()
    assert ok, reason
    kernels = resolve_kernels(torch.device("cpu"))
    assert kernels.kda_decode is kda_decode_native
    assert kernels.mla_attention is mla_attention_native
    assert kernels.moe_experts is moe_experts_native
    assert kernels.moe_route is moe_route_native
    assert kernels.silu_mul is silu_mul_native


def decode_inputs(B: int, H: int, K: int, N: int, seed: int) -> dict:
    g = gen(seed)
    C = 3 * H * K
    return {
        "conv_weight": torch.randn(C, W, generator=g), "A_log": torch.rand(H, generator=g) * 2,
        "dt_bias": torch.randn(H * K, generator=g), "norm_weight": torch.randn(K, generator=g),
        "eps": 1e-5, "state": torch.randn(N, H, K, K, generator=g),
        "conv_state": torch.randn(N, W - 1, C, generator=g),
        "state_slots": torch.randperm(N, generator=g)[:B]}


def step_inputs(B: int, H: int, K: int, seed: int) -> dict:
    g = gen(seed)
    # gate logits up to +-8: both strong and negligible decay occur
    return {"qkv": torch.randn(B, 3 * H * K, generator=g),
            "f": torch.randn(B, H, K, generator=g) * 4, "beta": torch.randn(B, H, generator=g),
            "z": torch.randn(B, H, K, generator=g)}


@pytest.mark.parametrize("V", [8, 16, 24, 37, 128])
def test_kda_chunk_native_value_widths(V: int) -> None:
    """The prefill scan runs value columns in blocks of two host vectors, then one, then
    single columns: widths that leave every kind of remainder (8 lanes on AVX2, 16 on
    AVX-512), with an empty sequence in the batch and snapshots, against the reference."""
    g = gen(11)
    H, K, lengths = 3, 20, [5, 0, 33, 1]
    T, B = sum(lengths), len(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q, k = torch.randn(T, H, K, generator=g), torch.randn(T, H, K, generator=g)
    v, f = torch.randn(T, H, V, generator=g), torch.randn(T, H, K, generator=g) * 4
    beta, A_log = torch.randn(T, H, generator=g), torch.rand(H, generator=g) * 2
    dt_bias = torch.randn(H * K, generator=g)
    pool = torch.randn(2 * B + 2, H, K, V, generator=g)
    ref_pool = pool.clone()
    slots = torch.tensor([4, 0, 7, 2])
    snaps = (torch.tensor([2, 5 + 16, T - 1]), torch.tensor([1, 3, 5]))
    args = (q, k, v, f, beta, A_log, dt_bias)
    o = kda_chunk_native(*args, pool, slots, cu, snaps)
    o_ref = kda_chunk_ref(*args, ref_pool, slots, cu, snaps)
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(pool, ref_pool, atol=2e-5, rtol=1e-4)


def test_kda_chunk_native_reads_column_slices() -> None:
    """q, k and v as the layer hands them over (column slices of one conv output, beta a
    column of the input projection's): read in place, the same result as contiguous copies
    and the reference."""
    g = gen(12)
    H, K, V, lengths = 2, 24, 40, [7, 19]
    T = sum(lengths)
    cu = torch.tensor([0, 7, 26])
    conv_out = torch.randn(T, 2 * H * K + H * V + 3, generator=g)[:, 3:]
    q, k, v = (conv_out[:, a:b].view(T, H, -1) for a, b in (
        (0, H * K), (H * K, 2 * H * K), (2 * H * K, 2 * H * K + H * V)))
    proj = torch.randn(T, 5 + H, generator=g)
    beta = proj[:, 5:]
    assert not (q.is_contiguous() or beta.is_contiguous())
    f, A_log = torch.randn(T, H, K, generator=g) * 4, torch.rand(H, generator=g) * 2
    dt_bias = torch.randn(H * K, generator=g)
    pool = torch.randn(3, H, K, V, generator=g)
    pools = [pool.clone() for _ in range(3)]
    slots = torch.tensor([2, 0])
    args = (q, k, v, f, beta, A_log, dt_bias)
    dense = tuple(t.contiguous() for t in args)
    o = kda_chunk_native(*args, pools[0], slots, cu)
    o_dense = kda_chunk_native(*dense, pools[1], slots, cu)
    o_ref = kda_chunk_ref(*args, pools[2], slots, cu)
    assert torch.equal(o, o_dense) and torch.equal(pools[0], pools[1])
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(pools[0], pools[2], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("V", [16, 37, 128])
def test_gated_rmsnorm_native_matches_reference_and_decode(V: int) -> None:
    """The prefill's output norm (the fused decode step's own row function) against the
    reference; other dtypes take the reference."""
    from kdaserve.kernels.native.ops import gated_rmsnorm_native
    from kdaserve.kernels.ref.kda import gated_rmsnorm

    g = gen(V)
    o, z = torch.randn(9, 3, V, generator=g) * 3, torch.randn(9, 3, V, generator=g) * 4
    w = torch.randn(V, generator=g)
    out = gated_rmsnorm_native(o, z, w, 1e-5)
    torch.testing.assert_close(out, gated_rmsnorm(o, z, w, 1e-5), atol=1e-5, rtol=1e-5)
    ob = o.bfloat16()
    torch.testing.assert_close(gated_rmsnorm_native(ob, z.bfloat16(), w.bfloat16(), 1e-5),
                               gated_rmsnorm(ob, z.bfloat16(), w.bfloat16(), 1e-5))


@pytest.mark.parametrize("fn", [kda_decode_native, kda_decode_cpu], ids=["native", "cpu"])
@pytest.mark.parametrize("B,H,K", [(1, 1, 16), (9, 3, 16), (3, 2, 24), (33, 2, 64), (4, 2, 128)])
def test_kda_decode_matches_reference(fn, B: int, H: int, K: int) -> None:
    """K 24: the register blocks and the scalar columns after them (delta_step)."""
    N = B + 5
    ours, ref = decode_inputs(B, H, K, N, seed=B), decode_inputs(B, H, K, N, seed=B)
    untouched = [i for i in range(N) if i not in ours["state_slots"].tolist()]
    before = ours["state"][untouched].clone(), ours["conv_state"][untouched].clone()
    for step in range(3):
        x = step_inputs(B, H, K, seed=100 + step)
        o = fn(**x, **ours)
        o_ref = kda_decode_ref(**x, **ref)
        torch.testing.assert_close(o, o_ref, atol=3e-5, rtol=1e-4)
        torch.testing.assert_close(ours["state"], ref["state"], atol=3e-5, rtol=1e-4)
        torch.testing.assert_close(ours["conv_state"], ref["conv_state"])
    assert torch.equal(ours["state"][untouched], before[0]), "wrote to slots it does not own"
    assert torch.equal(ours["conv_state"][untouched], before[1])


@pytest.mark.parametrize("fn", [kda_decode_native, kda_decode_cpu, bi.kda_decode_bi],
                         ids=["native", "cpu", "batch_invariant"])
def test_kda_decode_few_tokens_per_sequence(fn) -> None:
    """A verify-shaped batch (1-8 tokens per sequence, `cu_seqlens`): outputs and both pools
    as the reference's; the native kernel's outputs and states are
    bit-identical to the same tokens run as single decodes (the rollback relies on a verify
    leaving exactly what decoding would)."""
    H, K, lengths = 2, 64, [8, 1, 5]
    B, T = len(lengths), sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    ours, ref = decode_inputs(B, H, K, B + 3, seed=21), decode_inputs(B, H, K, B + 3, seed=21)
    x = step_inputs(T, H, K, seed=22)
    o = fn(**x, **ours, cu_seqlens=cu)
    o_ref = kda_decode_ref(**x, **ref, cu_seqlens=cu)
    torch.testing.assert_close(o, o_ref, atol=3e-5, rtol=1e-4)
    torch.testing.assert_close(ours["state"], ref["state"], atol=3e-5, rtol=1e-4)
    torch.testing.assert_close(ours["conv_state"], ref["conv_state"])
    if fn is not kda_decode_native:
        return
    single = decode_inputs(B, H, K, B + 3, seed=21)
    slots = single.pop("state_slots")
    for b in range(B):
        for t in range(int(cu[b]), int(cu[b + 1])):
            row = {name: v[t:t + 1] for name, v in x.items()}
            assert torch.equal(kda_decode_native(**row, **single, state_slots=slots[b:b + 1]),
                               o[t:t + 1])
    assert torch.equal(single["state"], ours["state"])
    assert torch.equal(single["conv_state"], ours["conv_state"])


def test_kda_decode_native_gates_at_extremes() -> None:
    """The kernel's own exp / sigmoid / softplus (vectorised, not libm) at gate values far
    out in both tails: conv inputs of +-100s, decay logits of +-60 (softplus near 0 and far
    in its linear part, decays of 1 and 0), output gates of +-100: finite, and as the
    reference's."""
    B, H, K = 3, 2, 40  # 40: whole vectors and a tail on AVX2 and AVX-512
    ours, ref = decode_inputs(B, H, K, 5, seed=31), decode_inputs(B, H, K, 5, seed=31)
    x = step_inputs(B, H, K, seed=32)
    x["qkv"] = x["qkv"] * 100
    x["f"] = torch.linspace(-60, 60, B * H * K).view(B, H, K)
    x["z"] = torch.linspace(-100, 100, B * H * K).view(B, H, K)
    o = kda_decode_native(**x, **ours)
    o_ref = kda_decode_ref(**x, **ref)
    assert torch.isfinite(o).all() and torch.isfinite(ours["state"]).all()
    torch.testing.assert_close(o, o_ref, atol=3e-5, rtol=1e-4)
    torch.testing.assert_close(ours["state"], ref["state"], atol=3e-5, rtol=1e-4)


def test_kda_decode_native_falls_back_for_bf16() -> None:
    B, H, K, N = 3, 2, 16, 6
    ours, ref = decode_inputs(B, H, K, N, seed=7), decode_inputs(B, H, K, N, seed=7)
    x = {k: v.bfloat16() for k, v in step_inputs(B, H, K, seed=8).items()}
    for d in (ours, ref):
        d["conv_state"] = d["conv_state"].bfloat16()
    o = kda_decode_native(**x, **ours)
    assert o.dtype == torch.bfloat16
    torch.testing.assert_close(o, kda_decode_ref(**x, **ref), atol=2e-2, rtol=2e-2)


def paged_cache(ctx: list[int], block_size: int, R: int, Dr: int, seed: int):
    """A latent pool with every sequence's blocks scattered at random, plus spare blocks."""
    g = gen(seed)
    nb = sum(-(-c // block_size) for c in ctx) + 3
    cache = torch.randn(nb, block_size, R + Dr, generator=g)
    order = torch.randperm(nb, generator=g).tolist()
    table = torch.zeros(len(ctx), max(-(-c // block_size) for c in ctx), dtype=torch.int64)
    start = 0
    for b, c in enumerate(ctx):
        n = -(-c // block_size)
        table[b, :n] = torch.tensor(order[start:start + n])
        start += n
    return cache, table


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("H,Dv", [(3, 16), (6, 20), (13, 9)])
def test_mla_decode_native_matches_reference(block_size: int, H: int, Dv: int) -> None:
    """Head counts past a whole tile of queries and W_UV widths past a whole tile of rows (the
    tails: 3, 6, 13 queries a token; 16, 20, 9 output columns)."""
    Dn, Dr, R = 16, 8, 32
    ctx = [1, 200, 7, 64, 65, 13, 130]
    B = len(ctx)
    g = gen(block_size)
    cache, table = paged_cache(ctx, block_size, R, Dr, seed=block_size)
    q_nope, q_pe = torch.randn(B, H, Dn, generator=g), torch.randn(B, H, Dr, generator=g)
    w_uk, w_uv = torch.randn(H, Dn, R, generator=g) * 0.3, torch.randn(H, Dv, R, generator=g)
    args = (q_nope, q_pe, cache, table, torch.arange(B + 1), torch.tensor(ctx), w_uk, w_uv,
            0.2)
    torch.testing.assert_close(mla_attention_native(*args), mla_attention_ref(*args),
                               atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("new", [[1, 3], [16, 2, 5], [1, 40], [40, 1, 3, 17, 1]],
                         ids=["verify", "verify-batch", "prefill-mixed", "prefill-mixed-2"])
def test_mla_native_multi_token_matches_reference(new: list[int], monkeypatch) -> None:
    """Sequences with several new tokens: per-token decode rows (each seeing the cache up to
    its own position) up to VERIFY_MAX_TOKENS; longer chunks, and only they, in the prefill
    path, while the batch's decodes and verifies stay in the paged kernel."""
    H, Dn, Dr, Dv, R = 2, 8, 4, 8, 12
    ctx = [c + n for c, n in zip([5, 9, 30, 0, 11], new, strict=False)]
    prefilled: list[list[int]] = []

    def prefill(q_nope, q_pe, kv_cache, block_table, cu_seqlens, *rest):
        prefilled.append((cu_seqlens[1:] - cu_seqlens[:-1]).tolist())
        return mla_attention_cpu(q_nope, q_pe, kv_cache, block_table, cu_seqlens, *rest)

    monkeypatch.setattr(native_ops, "mla_attention_cpu", prefill)
    g = gen(3)
    cache, table = paged_cache(ctx, 4, R, Dr, seed=3)
    T = sum(new)
    q_nope, q_pe = torch.randn(T, H, Dn, generator=g), torch.randn(T, H, Dr, generator=g)
    w_uk, w_uv = torch.randn(H, Dn, R, generator=g), torch.randn(H, Dv, R, generator=g)
    cu = torch.tensor([0, *new]).cumsum(0)
    args = (q_nope, q_pe, cache, table, cu, torch.tensor(ctx), w_uk, w_uv, 0.3)
    torch.testing.assert_close(mla_attention_native(*args), mla_attention_ref(*args),
                               atol=1e-5, rtol=1e-5)
    assert prefilled == ([[n for n in new if n > VERIFY_MAX_TOKENS]]
                         if max(new) > VERIFY_MAX_TOKENS else [])


@pytest.mark.parametrize("lengths", [[1], [8], [5] * 16, [1, 40, 3, 1, 300]],
                         ids=["decode", "verify", "verify-batch", "ragged"])
@pytest.mark.parametrize("C", [24, 768, 600])
def test_short_conv_native_matches_reference(lengths: list[int], C: int) -> None:
    """Ragged sequences from random slots of a pool, run twice in a row so the second call
    starts from the windows the first one left (and a sequence shorter than the window
    shifts part of the old window through); the second input a column slice of a wider
    tensor (the layer's qkv part of its input projection), read in place."""
    g = gen(11)
    w = torch.randn(C, W, generator=g)
    pool = torch.randn(40, W - 1, C, generator=g)
    slots = torch.randperm(40, generator=g)[:len(lengths)]
    cu = torch.tensor([0, *lengths]).cumsum(0)
    ref_pool, nat_pool = pool.clone(), pool.clone()
    for sliced in (False, True):
        x = torch.randn(int(cu[-1]), C + 5 * sliced, generator=g)[:, :C]
        want = short_conv_ref(x, w, ref_pool, slots, cu)
        got = short_conv_native(x, w, nat_pool, slots, cu)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(nat_pool, ref_pool, atol=0, rtol=0)  # copies, exactly


def test_short_conv_native_falls_back_for_bf16() -> None:
    x, w = torch.randn(6, 32, dtype=torch.bfloat16), torch.randn(32, W)
    pool = torch.zeros(2, W - 1, 32, dtype=torch.bfloat16)
    cu, slots = torch.tensor([0, 6]), torch.tensor([1])
    want = short_conv_ref(x, w, pool.clone(), slots, cu)
    torch.testing.assert_close(short_conv_native(x, w, pool, slots, cu), want)


@pytest.mark.parametrize("shape", [(1, 2 * 256), (16, 2 * 13), (3, 5, 2 * 40), (200, 2 * 768)])
def test_silu_mul_native_matches_reference(shape: tuple[int, ...]) -> None:
    from kdaserve.kernels import silu_mul_ref

    x = torch.randn(*shape, generator=gen(6)) * 4  # a vector tail at 13 and 40, threads at 200
    x[0, ..., 0] = -100.0  # exp's clamped range: SiLU -> -0
    torch.testing.assert_close(silu_mul_native(x), silu_mul_ref(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(silu_mul_native(x.bfloat16()), silu_mul_ref(x.bfloat16()))
