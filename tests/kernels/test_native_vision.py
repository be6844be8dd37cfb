"""The vision tower's native ops against their references (kernels/ref/vision.py). Its bf16
attention on the BF16 dot instruction (csrc/image_attention_cpu.cpp), against float64
attention of the same bf16 inputs: its two roundings are the whole error: the probabilities
to bf16 for the second product (at most 2^-8 of each term, bf16's unit roundoff) and the
output to bf16 (2^-8 of it), so each output is within 2^-7 of sum_j p_j |v_j|.
Skipped where the library has no such kernel (no AVX512-BF16, or BF16 dots not asked for:
isa.bf16_dots()); the fallback to torch's kernel is tested everywhere. The tanh GELU and the
2-D RoPE (csrc/vision_cpu.cpp) in fp32 and bf16, on every host, against the references."""

from __future__ import annotations

import math

import pytest
import torch

from kdaserve.kernels import registry
from kdaserve.kernels.native.vision import (
    gelu_tanh_native,
    image_attention_native,
    image_attention_ready,
    rope_pairs_native,
)
from kdaserve.kernels.ref.vision import gelu_tanh_ref, image_attention_ref, rope_pairs_ref

needs_kernel = pytest.mark.skipif(not image_attention_ready(),
                                  reason="no BF16-dot image attention in this host's build")


def inputs(L: int, H: int, D: int, seed: int, scale: float = 1.0,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [L, H, D] bf16 as the tower has them: q, k contiguous (after RoPE), v a view of
    the fused qkv projection (rows 3 H D apart). Later keys are larger, so the running max grows
    from one key block to the next and the output's rescaling is exercised."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(L, 3, H, D, generator=g) * scale
    qkv[:, 1] *= torch.linspace(0.5, 1.5, L)[:, None, None]
    q, k, v = qkv.bfloat16().unbind(1)
    return q.contiguous(), k.contiguous(), v


def exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention [L, H, D] and the error scale sum_j p_j |v_j| beside it."""
    q, k, v = (t.double().transpose(0, 1) for t in (q, k, v))
    p = torch.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, -1)
    return (p @ v).transpose(0, 1), (p @ v.abs()).transpose(0, 1)


@needs_kernel
@pytest.mark.parametrize(("L", "H", "D", "scale"), [
    (1, 1, 32, 1.0), (5, 2, 64, 1.0), (47, 3, 128, 2.0), (49, 1, 128, 0.5),
    (100, 2, 96, 1.0), (513, 2, 128, 1.0), (1100, 1, 128, 3.0)])
def test_within_the_two_roundings_of_exact(L: int, H: int, D: int, scale: float) -> None:
    """Partial tiles everywhere: queries past a 12-row tile and a 48-row task, keys past a
    32-key tile and a 512-key block (513: a block of one key), head dims of 1 to 4 column
    slabs."""
    q, k, v = inputs(L, H, D, seed=L + D, scale=scale)
    got = image_attention_native(q, k, v)
    assert got.dtype == torch.bfloat16 and got.shape == (L, H, D)
    want, spread = exact(q, k, v)
    err = (got.double() - want).abs()
    assert bool((err <= 2.0**-7 * spread + 1e-6).all()), float((err / spread).max())
    # no worse than torch's own bf16 attention, on the mean
    theirs = (image_attention_ref(q, k, v).double() - want).abs()
    assert float(err.mean()) <= 1.1 * float(theirs.mean()) + 1e-7
    assert torch.equal(image_attention_native(q, k, v), got)  # the same bits again


@needs_kernel
def test_reads_only_its_rows_and_heads() -> None:
    """Rows of a wider tensor (the heads a slice of each row) and NaN beyond the last key:
    nothing outside the given rows reaches the output."""
    L, H, D = 40, 2, 64
    q, k, v = inputs(L, H, D, seed=3)
    wide = torch.full((L + 1, 3, H + 1, D), float("nan"), dtype=torch.bfloat16)
    wide[:L, 0, :H], wide[:L, 1, :H], wide[:L, 2, :H] = q, k, v
    got = image_attention_native(wide[:L, 0, :H], wide[:L, 1, :H], wide[:L, 2, :H])
    assert torch.equal(got, image_attention_native(q, k, v))


def test_other_inputs_take_torchs_kernel() -> None:
    """fp32 (the tower on a host without bf16 units) and head dims that are not a multiple of
    32 get exactly the reference's result, wherever the kernel exists."""
    for q, k, v in (tuple(t.float() for t in inputs(30, 2, 64, seed=1)), inputs(30, 2, 40, 2)):
        assert torch.equal(image_attention_native(q, k, v), image_attention_ref(q, k, v))


def test_the_registry_picks_the_kernel_where_the_host_has_it() -> None:
    cpu = torch.device("cpu")
    chosen = registry.resolve("image_attention", cpu)
    assert chosen is (image_attention_native if image_attention_ready() else image_attention_ref)
    assert registry.resolve("image_attention", cpu, "ref") is image_attention_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 40_000])
def test_gelu_tanh_is_torchs(dtype: torch.dtype, n: int) -> None:
    """Tails past a vector, and a size split between threads; values from -10 to 10 (the
    function's tails on both sides). Against the float64 function: fp32 within 1e-6, and
    bf16 within one rounding of it, or no further than torch's own bf16 result (which for
    x below ~-5 cancels 1 + tanh to nothing: x sigmoid(2u) here keeps those digits)."""
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 4).clamp(-10, 10).to(dtype)
    got, want = gelu_tanh_native(x), gelu_tanh_ref(x)
    assert got.dtype == dtype and got.shape == x.shape
    d = x.double()  # the function in float64, as x sigmoid(2u): no cancellation either
    exact = d * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (d + 0.044715 * d ** 3))
    err = (got.double() - exact).abs()
    if dtype == torch.bfloat16:
        theirs = (want.double() - exact).abs()
        assert bool((err <= torch.maximum(theirs, exact.abs() * 2.0**-8) + 1e-30).all())
    else:
        assert bool((err <= 1e-6 * (1 + exact.abs())).all()), float(err.max())
    assert torch.equal(gelu_tanh_native(x.view(1, n)).view(n), got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("L", "H", "D"), [(1, 1, 2), (7, 3, 18), (33, 2, 64), (300, 12, 128)])
def test_rope_pairs_is_the_reference(dtype: torch.dtype, L: int, H: int, D: int) -> None:
    """q and k as the tower has them (views of the fused qkv projection, rows 3 H D apart),
    head dims with a tail past a vector (18); cos / sin of real angles."""
    g = torch.Generator().manual_seed(L * D)
    qkv = torch.randn(L, 3, H, D, generator=g).to(dtype)
    angles = torch.rand(L, D // 2, generator=g) * 50
    cos, sin = angles.cos(), angles.sin()
    for x in qkv.unbind(1)[:2]:
        got = rope_pairs_native(x, cos, sin)
        assert got.dtype == dtype and got.shape == (L, H, D) and got.is_contiguous()
        if dtype == torch.float32:
            torch.testing.assert_close(got, rope_pairs_ref(x, cos, sin), atol=1e-6, rtol=1e-6)
        # against float64: fp32 products (a rounding of |a c| + |b s| each) rounded once to
        # the output's dtype
        a, b = x.double().unflatten(-1, (D // 2, 2)).unbind(-1)
        c, s = cos.double()[:, None], sin.double()[:, None]
        exact = torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2)
        pair = (a.abs() + b.abs()).repeat_interleave(2, -1)
        unit = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-24
        err = (got.double() - exact).abs()
        assert bool((err <= unit * exact.abs() + 2.0**-22 * pair).all())
