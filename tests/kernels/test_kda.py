"""KDA kernels vs fla's naive_recurrent_kda / naive_chunk_kda (independent reference)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kdaserve.kernels import registry
from kdaserve.kernels.ref.kda import kda_gate_ref, l2norm_ref, short_conv_ref

from .conftest import make_inputs

H, K, V = 2, 16, 16


def fla_reference(fla_naive, q, k, v, f, beta, A_log, dt_bias, cu, init):
    """Per sequence, through fla's naive recurrence; gate/l2norm/sigmoid applied by the caller
    as fla's functions expect (spec §6)."""
    outs, finals = [], []
    gate = kda_gate_ref(f, A_log, dt_bias)
    for b in range(len(cu) - 1):
        s, e = int(cu[b]), int(cu[b + 1])
        o, S = fla_naive.naive_recurrent_kda(
            l2norm_ref(q[s:e])[None], l2norm_ref(k[s:e])[None], v[s:e][None], gate[s:e][None],
            torch.sigmoid(beta[s:e])[None], initial_state=init[b:b + 1].clone(),
            output_final_state=True)
        outs.append(o[0])
        finals.append(S[0])
    return torch.cat(outs), torch.stack(finals)


OPS = [(op, b.name) for op in ("kda_recurrent", "kda_chunk") for b in registry.backends(op)
       if b.supports(torch.device("cpu"))[0]]  # triton: tests/kernels/test_triton.py


@pytest.mark.parametrize("op,backend", OPS, ids=[f"{o}-{b}" for o, b in OPS])
@pytest.mark.parametrize("lengths", [[1], [5], [64], [130], [1, 70, 3, 128, 200]],
                         ids=lambda L: "len" + "_".join(map(str, L)))
@pytest.mark.parametrize("with_init", [False, True], ids=["zero_state", "init_state"])
def test_kda_vs_fla_naive(fla_naive, op, backend, lengths, with_init):
    fn = registry.resolve(op, torch.device("cpu"), backend)
    q, k, v, f, beta, A_log, dt_bias, cu = make_inputs(lengths)
    B = len(lengths)
    pool = torch.zeros(B + 3, H, K, V)
    slots = torch.randperm(B + 3, generator=torch.Generator().manual_seed(1))[:B]
    if with_init:
        pool.normal_(generator=torch.Generator().manual_seed(2))
    init = pool[slots].clone()
    untouched = [i for i in range(B + 3) if i not in slots.tolist()]
    before = pool[untouched].clone()
    o = fn(q, k, v, f, beta, A_log, dt_bias, pool, slots, cu)
    o_ref, S_ref = fla_reference(fla_naive, q, k, v, f, beta, A_log, dt_bias, cu, init)
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(pool[slots], S_ref, atol=2e-5, rtol=1e-4)
    assert torch.equal(pool[untouched], before), "kernel wrote to slots it does not own"


def test_chunk_vs_fla_naive_chunk_strong_decay(fla_naive):
    """fla's own chunk reference with strong decay (exp-difference overflow guard)."""
    fn = registry.resolve("kda_chunk", torch.device("cpu"), "ref")
    q, k, v, f, beta, A_log, dt_bias, cu = make_inputs([128], seed=3, strong_decay=True)
    pool = torch.zeros(1, H, K, V)
    o = fn(q, k, v, f, beta, A_log, dt_bias, pool, torch.tensor([0]), cu)
    gate = kda_gate_ref(f, A_log, dt_bias)
    o_ref, S_ref = fla_naive.naive_chunk_kda(
        l2norm_ref(q)[None], l2norm_ref(k)[None], v[None], gate[None], torch.sigmoid(beta)[None],
        output_final_state=True)
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o, o_ref[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(pool[0], S_ref[0], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("split", [1, 63, 64, 100])
def test_prefill_then_decode_equals_one_prefill(split):
    chunk = registry.resolve("kda_chunk", torch.device("cpu"), "ref")
    rec = registry.resolve("kda_recurrent", torch.device("cpu"), "ref")
    q, k, v, f, beta, A_log, dt_bias, cu = make_inputs([150], seed=4)
    full_pool = torch.zeros(1, H, K, V)
    o_full = chunk(q, k, v, f, beta, A_log, dt_bias, full_pool, torch.tensor([0]), cu)
    pool = torch.zeros(1, H, K, V)
    slot = torch.tensor([0])
    parts = [chunk(q[:split], k[:split], v[:split], f[:split], beta[:split], A_log, dt_bias, pool,
                   slot, torch.tensor([0, split]))]
    for t in range(split, 150):  # then one token at a time, as decode does
        parts.append(rec(q[t:t + 1], k[t:t + 1], v[t:t + 1], f[t:t + 1], beta[t:t + 1], A_log,
                         dt_bias, pool, slot, torch.tensor([0, 1])))
    torch.testing.assert_close(torch.cat(parts), o_full, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(pool, full_pool, atol=2e-5, rtol=1e-4)


def test_gate_vs_softplus_definition():
    f = torch.tensor([[[-30.0, 0.0, 19.0, 25.0]]])
    A_log = torch.tensor([0.5])
    dt = torch.zeros(4)
    expected = -torch.exp(torch.tensor(0.5)) * torch.tensor(
        [torch.log1p(torch.exp(torch.tensor(-30.0))), torch.log(torch.tensor(2.0)),
         torch.log1p(torch.exp(torch.tensor(19.0))), 25.0])
    torch.testing.assert_close(kda_gate_ref(f, A_log, dt)[0, 0], expected)


@pytest.mark.parametrize("lengths", [[1], [3, 1, 9]])
def test_short_conv_matches_conv1d_and_continues(lengths):
    torch.manual_seed(0)
    D, W = 6, 4
    T = sum(lengths)
    x = torch.randn(T, D)
    w = torch.randn(D, W)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    state = torch.zeros(len(lengths), W - 1, D)
    y = short_conv_ref(x, w, state, torch.arange(len(lengths)), cu)
    for b in range(len(lengths)):
        xs = x[cu[b]:cu[b + 1]].t()[None]  # [1, D, n]
        ref = F.silu(F.conv1d(xs, w[:, None], padding=W - 1, groups=D)[..., : xs.shape[-1]])
        torch.testing.assert_close(y[cu[b]:cu[b + 1]], ref[0].t())
        tail = torch.cat([torch.zeros(W - 1, D), x[cu[b]:cu[b + 1]]])[-(W - 1):]
        torch.testing.assert_close(state[b], tail)


CHUNK_CPU = [b.name for b in registry.backends("kda_chunk") if b.supports(torch.device("cpu"))[0]]


@pytest.mark.parametrize("backend", CHUNK_CPU)
def test_kda_chunk_snapshots_are_the_states_of_prefixes(backend: str) -> None:
    """Snapshot rows mid-sequence (two in one sequence), at a sequence's first and last
    token: each snapshot slot holds the state of that prefix run alone, and outputs and
    final states are those of the call without snapshots."""
    fn = registry.resolve("kda_chunk", torch.device("cpu"), backend)
    ref = registry.resolve("kda_recurrent", torch.device("cpu"), "ref")
    lengths = [1, 70, 3, 128, 40]
    q, k, v, f, beta, A_log, dt_bias, cu = make_inputs(lengths, seed=5)
    B = len(lengths)
    init = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(6))
    rows = torch.tensor([int(cu[1]) + 20, int(cu[1]) + 63, int(cu[2]), int(cu[4]) - 1, 0])
    dst = torch.tensor([B + 0, B + 1, B + 2, B + 3, B + 4])
    pool, plain = torch.zeros(2 * B, H, K, V), torch.zeros(2 * B, H, K, V)
    pool[:B], plain[:B] = init, init
    slots = torch.arange(B)
    o = fn(q, k, v, f, beta, A_log, dt_bias, pool, slots, cu, snapshots=(rows, dst))
    o_plain = fn(q, k, v, f, beta, A_log, dt_bias, plain, slots, cu)
    torch.testing.assert_close(o, o_plain, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(pool[:B], plain[:B], atol=2e-5, rtol=1e-4)
    for r, d in zip(rows.tolist(), dst.tolist(), strict=True):
        b = int((cu[1:] <= r).sum())
        s = int(cu[b])
        alone = init[b:b + 1].clone()
        ref(*(x[s:r + 1] for x in (q, k, v, f, beta)), A_log, dt_bias, alone,
            torch.tensor([0]), torch.tensor([0, r + 1 - s]))
        torch.testing.assert_close(pool[d], alone[0], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("lengths", [[1, 70, 3, 128, 40], [33, 5, 64]])
@pytest.mark.parametrize("v_dim", [V, 59])
def test_native_scan_bits_do_not_depend_on_snapshots(lengths: list[int], v_dim: int) -> None:
    """The native scan with snapshot rows gives the outputs and states of the call without
    them to the bit (deterministic inference runs on it, and where snapshots fall depends on
    the chunking and the cache). Seen broken on an AVX2 host when the compiler contracted
    the sweep with snapshot stores into other fused multiply-adds than the one without."""
    fn = registry.resolve("kda_chunk", torch.device("cpu"), "native")
    # V = 59: blocks of two vectors, one vector and single columns on any host's lanes
    q, k, v, f, beta, A_log, dt_bias, cu = make_inputs(lengths, seed=7)
    B, T = len(lengths), int(cu[-1])
    v = torch.randn(T, H, v_dim, generator=torch.Generator().manual_seed(9)) if v_dim != V else v
    init = torch.randn(B, H, K, v_dim, generator=torch.Generator().manual_seed(8))
    rows = torch.arange(0, T, 3)
    pool, plain = torch.zeros(B + len(rows), H, K, v_dim), torch.zeros(B, H, K, v_dim)
    pool[:B], plain[:] = init, init
    slots = torch.arange(B)
    o = fn(q, k, v, f, beta, A_log, dt_bias, pool, slots, cu,
           snapshots=(rows, torch.arange(B, B + len(rows))))
    o_plain = fn(q, k, v, f, beta, A_log, dt_bias, plain, slots, cu)
    assert torch.equal(o, o_plain) and torch.equal(pool[:B], plain)


def test_conv_windows_are_the_last_rows_of_old_then_new() -> None:
    """The snapshot windows after n[s] more rows, against concatenating per sequence: n below,
    at and above W-1 (windows mixing old and new rows, and only new ones)."""
    from kdaserve.layers.kda import conv_windows

    g = torch.Generator().manual_seed(0)
    S, W1, C = 5, 3, 7
    old = torch.randn(S, W1, C, generator=g)
    rows = torch.randn(40, C, generator=g)
    starts = torch.tensor([0, 4, 10, 21, 30])
    n = torch.tensor([1, 2, 3, 6, 10])
    want = torch.stack([torch.cat([old[s], rows[starts[s]:starts[s] + n[s]]])[-W1:]
                        for s in range(S)])
    assert torch.equal(conv_windows(old, rows, starts, n), want)
