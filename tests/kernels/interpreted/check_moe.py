"""Run by tests/kernels/test_triton_interpreted.py in a process of its own, with triton on the
path and TRITON_INTERPRET=1: the fused MoE's Triton kernels on CPU against the reference."""

from __future__ import annotations

import pytest
import torch

from kdaserve.kernels.ref.moe import moe_experts_ref
from kdaserve.kernels.ref.quant import quantize_int8
from kdaserve.kernels.triton.moe import BLOCK_M, align_by_expert, moe_experts_triton


def _case(T: int, D: int, inter: int, E: int, k: int, seed: int):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    w13 = torch.randn(E, 2 * inter, D, generator=g) / D ** 0.5
    w2 = torch.randn(E, D, inter, generator=g) / inter ** 0.5
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else \
        torch.zeros(0, k, dtype=torch.int64)
    weights = torch.rand(T, k, generator=g)
    return x, weights, ids, w13, w2


@pytest.mark.parametrize("T,D,inter,E,k", [
    (1, 32, 16, 4, 2),  # a decode: one token, most experts idle
    (5, 48, 40, 8, 2),  # dimensions that are not tile multiples
    (37, 64, 32, 6, 3),  # experts with runs longer than a block
])
def test_fused_moe_matches_reference(T: int, D: int, inter: int, E: int, k: int) -> None:
    x, weights, ids, w13, w2 = _case(T, D, inter, E, k, seed=T)
    want = moe_experts_ref(x, weights, ids, w13, w2)
    got = moe_experts_triton(x, weights, ids, w13, w2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fused_moe_int8_weights() -> None:
    x, weights, ids, w13, w2 = _case(9, 32, 24, 4, 2, seed=3)
    q13, s13 = quantize_int8(w13)
    q2, s2 = quantize_int8(w2)
    want = moe_experts_ref(x, weights, ids, q13, q2, s13, s2)
    got = moe_experts_triton(x, weights, ids, q13, q2, s13, s2)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("situ", [None, (4.0, 25.0)])
@pytest.mark.parametrize("T,D,inter,E,k", [(1, 64, 32, 4, 2), (19, 96, 64, 6, 3)])
def test_fused_moe_mxfp4_weights(T: int, D: int, inter: int, E: int, k: int,
                                 situ: tuple[float, float] | None) -> None:
    """MXFP4 (W4A16): the codes and scales decoded in the K loop give the reference's product
    with its dequantized weights, every E2M1 code and the extreme scales among them. fp32
    activations only: this Triton's interpreter misreads bf16 tensors (a bf16 tl.dot of
    plain weights is off by ~1e10 here too), so bf16 is left to a GPU run."""
    from kdaserve.kernels.ref.mxfp4 import quantize_mxfp4

    x, weights, ids, w13, w2 = _case(T, D, inter, E, k, seed=T + 7)
    q13, s13 = quantize_mxfp4(w13)
    q2, s2 = quantize_mxfp4(w2)
    g = torch.Generator().manual_seed(5)
    q13[0, :16] = torch.randint(0, 256, (16, D // 2), generator=g, dtype=torch.uint8)
    s13[0, 0, 0], s13[0, 1, 0] = 0, 140  # 2^-127 (subnormal) and a large scale
    want = moe_experts_ref(x, weights, ids, q13, q2, s13, s2, situ=situ)
    got = moe_experts_triton(x, weights, ids, q13, q2, s13, s2, situ=situ)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_empty_batch() -> None:
    x, weights, ids, w13, w2 = _case(0, 32, 16, 4, 2, seed=0)
    assert moe_experts_triton(x, weights, ids, w13, w2).shape == (0, 32)


def test_align_by_expert_groups_and_pads() -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    pairs, block_expert = align_by_expert(ids, 4, block_m=2)
    n = ids.numel()
    assert pairs.numel() == block_expert.numel() * 2 >= n + 4 * 1
    seen = []
    for b, e in enumerate(block_expert.tolist()):
        rows = pairs[b * 2:(b + 1) * 2].tolist()
        if e < 0:
            assert rows == [n, n]
            continue
        assert all(r == n or ids.flatten()[r] == e for r in rows)
        seen += [r for r in rows if r < n]
    assert sorted(seen) == list(range(n))  # every pair once
    assert block_expert.tolist()[:4] == [0, 1, 2, 2]  # expert 2 has three pairs: two blocks
    assert BLOCK_M >= 16


@pytest.mark.parametrize("T,k,E,block_m", [(50, 3, 7, 4), (3, 2, 16, 16), (64, 8, 8, 16)])
def test_align_by_expert_random(T: int, k: int, E: int, block_m: int) -> None:
    g = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    pairs, block_expert = align_by_expert(ids, E, block_m)
    n, flat = ids.numel(), ids.flatten()
    blocks = pairs.view(-1, block_m)
    counts = torch.bincount(flat, minlength=E)
    used = int(((counts + block_m - 1) // block_m).sum())
    assert (block_expert[:used] >= 0).all() and (block_expert[used:] == -1).all()
    assert (block_expert[:used].diff() >= 0).all()  # runs in expert order
    assert (blocks[used:] == n).all()
    real = blocks[:used][blocks[:used] < n]
    assert sorted(real.tolist()) == list(range(n))
    for b in range(used):
        row = blocks[b][blocks[b] < n]
        assert row.numel() > 0 and (flat[row] == block_expert[b]).all()


@pytest.mark.parametrize("T,E,k,activation,bias,renormalize", [
    (1, 8, 2, "sigmoid", True, True),
    (37, 64, 8, "sigmoid", True, True),  # Kimi's scoring at a prefill size
    (5, 256, 8, "sigmoid", False, False),
    (20, 16, 4, "softmax", False, True),
])
def test_route_matches_reference(T: int, E: int, k: int, activation: str, bias: bool,
                                 renormalize: bool) -> None:
    from kdaserve.kernels.ref.moe import moe_route_ref
    from kdaserve.kernels.triton.moe import moe_route_triton

    g = torch.Generator().manual_seed(E + T)
    logits = torch.randn(T, E, generator=g) * 2
    b = torch.randn(E, generator=g) * 0.5 if bias else None
    args = (logits, b, k, 1, 1, renormalize, 2.446, activation)
    w, ids = moe_route_triton(*args)
    w_ref, ids_ref = moe_route_ref(*args)
    assert torch.equal(ids, ids_ref)  # continuous scores: no ties, the same order
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("T,E,k,groups,kept,bias", [
    (6, 16, 4, 4, 2, True),  # the small preset's routing
    (19, 256, 8, 8, 4, True),  # DeepSeek-V3's: 8 groups of 32, 4 kept
    (5, 64, 6, 8, 3, False),
    (7, 8, 2, 8, 3, True),  # groups of one expert: a group scores its one choice
])
def test_grouped_route_matches_reference(T: int, E: int, k: int, groups: int, kept: int,
                                         bias: bool) -> None:
    """Group-limited choice in the kernel: the best two choices of each group score it,
    only the `kept` best groups' experts can be chosen."""
    from kdaserve.kernels.ref.moe import moe_route_ref
    from kdaserve.kernels.triton.moe import moe_route_triton

    g = torch.Generator().manual_seed(T + E + groups)
    logits = torch.randn(T, E, generator=g) * 2
    b = torch.randn(E, generator=g) * 0.5 if bias else None
    args = (logits, b, k, groups, kept, True, 2.446, "sigmoid")
    w, ids = moe_route_triton(*args)
    w_ref, ids_ref = moe_route_ref(*args)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)
    # the chosen experts lie in `kept` groups at most; with groups of several experts plain
    # top-k would differ somewhere (groups of one only bind past k = kept)
    assert all(len({int(e) // (E // groups) for e in row}) <= kept for row in ids)
    if E // groups > 1:
        plain = moe_route_ref(logits, b, k, 1, 1, True, 2.446, "sigmoid")[1]
        assert not torch.equal(plain, ids_ref)


def test_grouped_route_refuses_uneven_groups() -> None:
    from kdaserve.kernels.triton.moe import moe_route_triton

    with pytest.raises(ValueError, match="groups"):
        moe_route_triton(torch.randn(2, 10), None, 2, 4, 2, True, 1.0, "sigmoid")
