"""The native MoE kernels (csrc/moe_cpu.cpp) against the plain-torch references: experts at
every batch, with each expert's tokens as blocks or its weight rows split, fp32 / bf16 / int8
weights; and the router's top-k."""

from __future__ import annotations

import pytest
import torch

from kdaserve.kernels.cpu.moe import moe_experts_cpu
from kdaserve.kernels.native.ops import moe_experts_native, moe_route_native
from kdaserve.kernels.ref.moe import moe_experts_ref, moe_route_ref


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("T", [1, 5, 40, 200, 700])
@pytest.mark.parametrize("backend", ["native", "native-blocked", "native-split", "cpu"])
@pytest.mark.parametrize("D", [40, 43])
def test_moe_experts_match_reference(T: int, backend: str, D: int) -> None:
    """Each token's k choices hit distinct experts, some experts get no token; the native
    kernel with its own choice per expert, with every expert in token blocks (700 tokens: ~210
    an expert, several blocks each, the last ones partial) and with none (each expert a task
    of its own, whatever its tokens, or at 1 token, fewer experts than two a thread, their
    weight rows split over the threads). D = 43: the blocks' transposes in and out (8 x 8 in
    registers on AVX2) and the output's 16-wide gathers on AVX-512 end in a scalar tail."""
    import kdaserve.kernels.native.ops as native_ops

    E, inter, k = 12, 24, 3
    g = gen(T)
    x = torch.randn(T, D, generator=g)
    w13 = torch.randn(E, 2 * inter, D, generator=g)
    w2 = torch.randn(E, D, inter, generator=g)
    ids = torch.stack([torch.randperm(E - 2, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    blocked_from = {"native": None, "native-blocked": 1, "native-split": 2**40}.get(backend)
    if backend == "cpu":
        out = moe_experts_cpu(x, weights, ids, w13, w2)
    else:
        out = native_ops.moe_experts_native(x, weights, ids, w13, w2,
                                            blocked_from=blocked_from)
    # against float64: outputs reach ~1,000 here, and an fp32 sum in another order is off by
    # a few 1e-4 wherever terms that large cancel to a small result
    want = moe_experts_ref(x.double(), weights.double(), ids, w13.double(), w2.double())
    torch.testing.assert_close(out.double(), want, atol=1e-6 * float(want.abs().max()),
                               rtol=1e-5)


def test_moe_native_gathers_many_small_rows_threaded() -> None:
    """Every expert's weight rows split over the threads with 3,000 tokens: the gather of
    their 9,000 x 128 rows is threaded (from 2^20 floats), the decode-sized one is not."""
    E, inter, D, k, T = 12, 24, 128, 3, 3000
    g = gen(7)
    x = torch.randn(T, D, generator=g)
    w13 = torch.randn(E, 2 * inter, D, generator=g) / D**0.5  # unit-sized sums
    w2 = torch.randn(E, D, inter, generator=g) / inter**0.5
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    out = moe_experts_native(x, weights, ids, w13, w2, blocked_from=2**40)
    torch.testing.assert_close(out, moe_experts_ref(x, weights, ids, w13, w2), atol=1e-4,
                               rtol=1e-4)


@pytest.mark.parametrize("T", [1, 2, 3, 4, 9])
def test_bf16_experts_of_few_tokens_are_fp32_class(T: int) -> None:
    """Experts of 1-4 tokens stream their bf16 rows (on the BF16 dots with split activations
    where ops.dot_bf16(); widened elsewhere), wide enough (D 160, I 96) for whole 32-element
    dots and a tail: near float64 arithmetic on the same weights, far nearer than rounding
    the activations to bf16 would be."""
    g = gen(100 + T)
    E, D, inter, k = 4, 160, 96, 2
    x = torch.randn(T, D, generator=g)
    w13 = (torch.randn(E, 2 * inter, D, generator=g) * 0.2).bfloat16()
    w2 = (torch.randn(E, D, inter, generator=g) * 0.2).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.ones(T, k)
    out = moe_experts_native(x, weights, ids, w13, w2, blocked_from=2**40).double()
    want = moe_experts_ref(x.double(), weights.double(), ids, w13.double(), w2.double())
    # each output's scale: its sums of absolute terms, |x| |w_gate| |x| |w_up| |w2| (|SiLU(g)|
    # <= |g|). The largest error as a fraction of 2^-20 of it, measured: widened 5e-4, split
    # 0.015, activations rounded to bf16 (the lo parts dropped) 6-9
    a = x.double().abs()
    G = torch.einsum("td,eid->tei", a, w13[:, :inter].double().abs())
    U = torch.einsum("td,eid->tei", a, w13[:, inter:].double().abs())
    scale = torch.einsum("tei,edi->ted", G * U, w2.double().abs())
    limit = 2.0**-20 * torch.stack([scale[t, ids[t]].sum(0) for t in range(T)])
    err = (out - want).abs()
    assert bool((err <= limit).all()), float((err / limit).max())


@pytest.mark.parametrize("blocked_from", [1, 2**40])
@pytest.mark.parametrize("T", [1, 5, 200])
def test_moe_native_with_bf16_weights(T: int, blocked_from: int) -> None:
    """Both paths; on an AMX host the token blocks run on the tiles (amx_cpu.cpp), with
    padded panels (2I = 48 rows) and partial chunks (D = 40, I = 24)."""
    g = gen(T)
    E, D, inter, k = 6, 40, 24, 2
    x = torch.randn(T, D, generator=g)
    w13 = (torch.randn(E, 2 * inter, D, generator=g) * 0.2).bfloat16()
    w2 = (torch.randn(E, D, inter, generator=g) * 0.2).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    out = moe_experts_native(x, weights, ids, w13, w2, blocked_from=blocked_from)
    torch.testing.assert_close(out, moe_experts_ref(x, weights, ids, w13.float(), w2.float()),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("blocked_from", [1, 2**40])
@pytest.mark.parametrize("T", [1, 5, 12, 200])
# widths past a 64-byte line of int8 weights and with scalar tails: the row tiles of
# 2-4-token experts (stream_rows) read weights a line a step
@pytest.mark.parametrize(("D", "inter"), [(40, 24), (43, 37), (136, 72)])
def test_moe_native_with_int8_weights(T: int, blocked_from: int, D: int, inter: int) -> None:
    from kdaserve.kernels.ref.quant import dequantize, quantize_int8

    g = gen(T + 1)
    E, k = 6, 2
    x = torch.randn(T, D, generator=g)
    (q13, s13), (q2, s2) = (quantize_int8(torch.randn(*shape, generator=g) * 0.2)
                            for shape in ((E, 2 * inter, D), (E, D, inter)))
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    want = moe_experts_ref(x, weights, ids, dequantize(q13, s13, torch.float32),
                           dequantize(q2, s2, torch.float32))
    torch.testing.assert_close(moe_experts_native(x, weights, ids, q13, q2, s13, s2,
                                                  blocked_from=blocked_from), want,
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(moe_experts_ref(x, weights, ids, q13, q2, s13, s2), want,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T", [1, 7, 100])  # 100: the threaded path
@pytest.mark.parametrize(("E", "k", "groups", "keep", "renorm", "activation", "bias"), [
    (8, 2, 1, 1, True, "sigmoid", True),  # the trained target's router
    (64, 8, 1, 1, True, "sigmoid", True),  # the bench preset's
    (16, 4, 4, 2, True, "sigmoid", True),  # grouped (DeepSeek-V3's)
    (16, 3, 8, 3, False, "softmax", False),
    (12, 12, 1, 1, True, "softmax", True),  # every expert chosen
])
def test_moe_route_native_matches_reference(T: int, E: int, k: int, groups: int, keep: int,
                                            renorm: bool, activation: str, bias: bool) -> None:
    g = gen(T + E)
    logits = torch.randn(T, E, generator=g) * 3
    b = torch.randn(E, generator=g) * 0.5 if bias else None
    want_w, want_ids = moe_route_ref(logits, b, k, groups, keep, renorm, 2.5, activation)
    got_w, got_ids = moe_route_native(logits, b, k, groups, keep, renorm, 2.5, activation)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
    assert torch.equal(got_ids, want_ids)  # the same experts in the same (descending) order
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


def test_moe_route_native_breaks_ties_to_the_lower_expert() -> None:
    w, ids = moe_route_native(torch.zeros(2, 6), None, 3, 1, 1, True, 1.0, "sigmoid")
    assert ids.tolist() == [[0, 1, 2]] * 2
    torch.testing.assert_close(w, torch.full((2, 3), 1 / 3))
