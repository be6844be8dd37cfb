"""Kimi K3's new ops against references no one here wrote: fla-core's lower-bound gate and
naive recurrence (KDA), mlx-lm's SiTU and AttnRes combine (the functions its kimi_k3 model
runs on a CPU). Each backend that declares a K3 feature is checked."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from kdaserve.kernels import FEATURE_OPS, registry
from kdaserve.kernels.ref.attn_res import attn_res_mix_ref
from kdaserve.kernels.ref.kda import kda_gate_ref, l2norm_ref
from kdaserve.kernels.ref.mlp import sigmoid_mul_ref, situ_mul_ref

from .conftest import make_inputs

BOUND = -5.0
H, K = 2, 16


@pytest.fixture(scope="module")
def fla_gate() -> ModuleType:
    """fla's `naive_kda_lowerbound_gate`, taken out of fla/ops/kda/gate.py (whose module
    imports triton, which the test environment keeps off the path): torch only."""
    spec = importlib.util.find_spec("fla")
    if spec is None or spec.origin is None:
        pytest.skip("fla-core is not installed")
    source = (Path(spec.origin).parent / "ops" / "kda" / "gate.py").read_text()
    fn = next(n for n in ast.parse(source).body
              if isinstance(n, ast.FunctionDef) and n.name == "naive_kda_lowerbound_gate")
    module = ModuleType("_fla_gate")
    module.__dict__.update(torch=torch, F=F)
    exec(compile(ast.Module([fn], []), "fla/ops/kda/gate.py", "exec"), module.__dict__)  # noqa: S102
    return module


def test_lower_bound_gate_is_fla_naive_gate(fla_gate: ModuleType) -> None:
    g = torch.Generator().manual_seed(0)
    f = torch.randn(37, H, K, generator=g) * 4
    A_log, dt_bias = torch.rand(H, generator=g) * 3, torch.randn(H * K, generator=g)
    ours = kda_gate_ref(f, A_log, dt_bias, BOUND)
    ref = fla_gate.naive_kda_lowerbound_gate(f, A_log, dt_bias, BOUND)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)
    assert ours.min() >= BOUND and ours.max() <= 0


K3_KDA = [(op, b.name) for op in FEATURE_OPS["kda_lower_bound"] if op != "kda_decode"
          for b in registry.backends(op)
          if "kda_lower_bound" in b.features and b.supports(torch.device("cpu"))[0]]


@pytest.mark.parametrize("op,backend", K3_KDA, ids=[f"{o}-{b}" for o, b in K3_KDA])
@pytest.mark.parametrize("lengths", [[1], [1, 1, 1], [40], [3, 70, 17]],
                         ids=lambda L: "len" + "_".join(map(str, L)))
def test_kda_with_lower_bound_vs_fla_naive(fla_naive, fla_gate, op: str, backend: str,
                                           lengths: list[int]) -> None:
    fn = registry.resolve(op, torch.device("cpu"), backend,
                          features=frozenset({"kda_lower_bound"}))
    q, k, v, f, beta, A_log, dt_bias, cu = make_inputs(lengths, seed=4)
    B = len(lengths)
    pool = torch.randn(B + 1, H, K, v.shape[-1], generator=torch.Generator().manual_seed(5))
    init = pool[:B].clone()
    o = fn(q, k, v, f, beta, A_log, dt_bias, pool, torch.arange(B), cu, lower_bound=BOUND)
    gate = fla_gate.naive_kda_lowerbound_gate(f, A_log, dt_bias, BOUND)
    for b in range(B):
        s, e = int(cu[b]), int(cu[b + 1])
        o_ref, S_ref = fla_naive.naive_recurrent_kda(
            l2norm_ref(q[s:e])[None], l2norm_ref(k[s:e])[None], v[s:e][None], gate[s:e][None],
            torch.sigmoid(beta[s:e])[None], initial_state=init[b:b + 1].clone(),
            output_final_state=True)
        torch.testing.assert_close(o[s:e], o_ref[0], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(pool[b], S_ref[0], atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def mlx_k3() -> tuple[ModuleType, ModuleType]:
    mx = pytest.importorskip("mlx.core")
    return mx, pytest.importorskip("mlx_lm.models.kimi_k3")


def _mx(mx: ModuleType, t: torch.Tensor):  # noqa: ANN202 - an mx.array
    return mx.array(t.numpy())


def _torch(a) -> torch.Tensor:  # noqa: ANN001
    return torch.tensor(a.tolist(), dtype=torch.float32)


@pytest.mark.parametrize("linear_beta", [25.0, None])
def test_situ_is_mlx_lm_situ(mlx_k3, linear_beta: float | None) -> None:  # noqa: ANN001
    mx, k3 = mlx_k3
    g = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(33, 24, generator=g) * 20 for _ in range(2))  # past both caps
    ours = situ_mul_ref(torch.cat([gate, up], -1), 4.0, linear_beta)
    ref = _torch(k3._situ(_mx(mx, up), _mx(mx, gate), 4.0, linear_beta))
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_blocks", [0, 1, 3, 8])
def test_attn_res_mix_is_mlx_lm_combine(mlx_k3, num_blocks: int) -> None:  # noqa: ANN001
    mx, k3 = mlx_k3
    g = torch.Generator().manual_seed(num_blocks)
    T, D, eps = 11, 96, 1e-5
    bank = torch.randn(num_blocks, T, D, generator=g) * torch.rand(num_blocks, T, 1,
                                                                   generator=g) * 5
    partial = torch.randn(T, D, generator=g) * 3
    w_eff = torch.randn(D, generator=g)
    ours = attn_res_mix_ref(bank, partial, w_eff, eps)
    if num_blocks == 0:  # mlx-lm returns the partial sum itself before combining
        assert ours is partial
        return
    blocks = k3.ResidualBlocks(eps)
    for row in bank:
        blocks.append(_mx(mx, row))
    ref = _torch(k3._attn_res_combine(blocks.raw, blocks.inv_rms, _mx(mx, partial),
                                      _mx(mx, w_eff), eps))
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


K3_DECODE = [b.name for b in registry.backends("kda_decode")
             if "kda_lower_bound" in b.features and b.supports(torch.device("cpu"))[0]]


@pytest.mark.parametrize("backend", K3_DECODE)
@pytest.mark.parametrize("lengths", [None, [1, 3, 2]], ids=["decode", "verify"])
def test_kda_decode_with_lower_bound_is_the_reference(backend: str,
                                                      lengths: list[int] | None) -> None:
    """The whole fused step (conv, gate, delta rule, gated norm) of each backend with K3's
    gate against the plain-torch composition, whose gate and recurrence are checked above;
    head size 40 reaches the native kernels' lane tails."""
    from kdaserve.kernels.ref.kda import kda_decode_ref

    fn = registry.resolve("kda_decode", torch.device("cpu"), backend,
                          features=frozenset({"kda_lower_bound"}))
    g = torch.Generator().manual_seed(9)
    Hd, Kd, W = 3, 40, 4
    B = 3
    T = B if lengths is None else sum(lengths)
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0)])
    C = 3 * Hd * Kd
    qkv, f = torch.randn(T, C, generator=g), torch.randn(T, Hd, Kd, generator=g) * 3
    beta, z = torch.randn(T, Hd, generator=g), torch.randn(T, Hd, Kd, generator=g)
    conv_w = torch.randn(C, W, generator=g) / 2
    A_log, dt_bias = torch.rand(Hd, generator=g) * 2, torch.randn(Hd * Kd, generator=g)
    norm_w = 1 + 0.1 * torch.randn(Kd, generator=g)
    state = torch.randn(B + 2, Hd, Kd, Kd, generator=g)
    conv_state = torch.randn(B + 2, W - 1, C, generator=g)
    slots = torch.tensor([4, 0, 2])
    ref_state, ref_conv = state.clone(), conv_state.clone()
    want = kda_decode_ref(qkv, f, beta, z, conv_w, A_log, dt_bias, norm_w, 1e-5, ref_state,
                          ref_conv, slots, cu, lower_bound=BOUND)
    got = fn(qkv, f, beta, z, conv_w, A_log, dt_bias, norm_w, 1e-5, state, conv_state, slots,
             cu, lower_bound=BOUND)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(state, ref_state, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(conv_state, ref_conv)


SITU = (4.0, 25.0)


@pytest.mark.parametrize("backend", [b.name for b in registry.backends("situ_mul")
                                     if b.supports(torch.device("cpu"))[0]])
@pytest.mark.parametrize("linear_beta", [25.0, None])
def test_situ_mul_backends_are_the_reference(backend: str, linear_beta: float | None) -> None:
    fn = registry.resolve("situ_mul", torch.device("cpu"), backend)
    g = torch.Generator().manual_seed(3)
    gate_up = torch.randn(5, 2 * 37, generator=g) * 30  # past both caps; odd width: tails
    torch.testing.assert_close(fn(gate_up, beta=4.0, linear_beta=linear_beta),
                               situ_mul_ref(gate_up, 4.0, linear_beta), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", [b.name for b in registry.backends("sigmoid_mul")
                                     if b.supports(torch.device("cpu"))[0]])
@pytest.mark.parametrize("shape", [(1, 768), (3, 37), (2, 40000)])  # tails; a threaded size
def test_sigmoid_mul_backends_are_the_reference(backend: str, shape: tuple[int, int]) -> None:
    """MLA's output gate: x * sigmoid(gate), gates past where sigmoid saturates."""
    fn = registry.resolve("sigmoid_mul", torch.device("cpu"), backend)
    g = torch.Generator().manual_seed(shape[1])
    x, gate = torch.randn(*shape, generator=g) * 3, torch.randn(*shape, generator=g) * 40
    got = fn(x, gate)
    torch.testing.assert_close(got, sigmoid_mul_ref(x, gate), atol=1e-6, rtol=1e-6)
    if backend != "ref":  # torch's own sigmoid takes a scalar path for a row's tail
        assert torch.equal(fn(x[:1], gate[:1]), got[:1])  # a row alone: the same values


SITU_EXPERTS = [b.name for b in registry.backends("moe_experts")
                if "situ" in b.features and b.supports(torch.device("cpu"))[0]]


@pytest.mark.parametrize("backend", SITU_EXPERTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("tokens", [1, 3, 37])
def test_situ_experts_are_the_reference(backend: str, dtype: torch.dtype, tokens: int) -> None:
    """SiTU inside the experts' kernels, every weight format, both of the native kernel's
    paths (small experts' streamed rows, token blocks), odd widths for the lane tails."""
    from kdaserve.kernels.ref.moe import moe_experts_ref
    from kdaserve.kernels.ref.quant import quantize_int8

    fn = registry.resolve("moe_experts", torch.device("cpu"), backend,
                          features=frozenset({"situ"}))
    g = torch.Generator().manual_seed(tokens)
    E, D, inter, k = 6, 40, 24, 3
    x = torch.randn(tokens, D, generator=g) * 2
    w13 = torch.randn(E, 2 * inter, D, generator=g)  # large: SiTU's caps are reached
    w2 = torch.randn(E, D, inter, generator=g) / inter ** 0.5
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    s13 = s2 = None
    if dtype == torch.int8:
        (w13, s13), (w2, s2) = quantize_int8(w13), quantize_int8(w2)
    else:
        w13, w2 = w13.to(dtype), w2.to(dtype)
    if backend == "batch_invariant" and dtype != torch.float32:
        with pytest.raises(ValueError, match="fp32"):  # refused by name, never widened
            fn(x, weights, ids, w13, w2, s13, s2, situ=SITU)
        return
    want = moe_experts_ref(x, weights, ids, w13, w2, s13, s2, situ=SITU)
    # bf16 and int8 weights may meet activations rounded to bf16 halves (the BF16 dots, AMX
    # tiles: gemm_blocks.h), about 2^-16 of each product: judged against the output's scale,
    # far below what a wrong activation (SiLU for SiTU: O(1)) would leave
    tol = 1e-4 if dtype == torch.float32 else 1e-3 * want.abs().max().item()
    runs = [{}] if backend != "native" else [{"blocked_from": 2**40}, {"blocked_from": 1}]
    for extra in runs:
        got = fn(x, weights, ids, w13, w2, s13, s2, situ=SITU, **extra)
        torch.testing.assert_close(got, want, atol=tol, rtol=1e-4)


@pytest.mark.parametrize("backend", [b.name for b in registry.backends("attn_res_norm")
                                     if b.supports(torch.device("cpu"))[0]])
@pytest.mark.parametrize("num_blocks", [0, 1, 8])
def test_attn_res_norm_backends_are_mix_then_norm(backend: str, num_blocks: int) -> None:
    """Each backend's fused mix + RMSNorm against the mix checked above and the RMSNorm;
    D = 77 reaches the lane tails, one dominant source tests the softmax's range."""
    from kdaserve.kernels.ref.norm import rms_norm_ref

    fn = registry.resolve("attn_res_norm", torch.device("cpu"), backend)
    g = torch.Generator().manual_seed(num_blocks + 10)
    T, D = 6, 77
    bank = torch.randn(num_blocks, T, D, generator=g) * 4
    partial, w_eff = torch.randn(T, D, generator=g), torch.randn(D, generator=g) * 3
    norm_w = 1 + 0.1 * torch.randn(D, generator=g)
    want = rms_norm_ref(attn_res_mix_ref(bank, partial, w_eff, 1e-5), norm_w, 1e-5)
    got = fn(bank, partial, w_eff, 1e-5, norm_w, 1e-5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_k3_resolves_native_kernels_here() -> None:
    """On a CPU with the native library (test_native.py asserts it builds), a K3 model gets
    the native kernels for its new work, not the references."""
    from kdaserve.kernels import resolve_kernels
    from kdaserve.kernels.native import k3, ops

    k = resolve_kernels(torch.device("cpu"), features=frozenset({"kda_lower_bound", "situ"}))
    assert (k.kda_chunk, k.kda_decode, k.moe_experts, k.situ_mul, k.sigmoid_mul,
            k.attn_res_norm) == (
        ops.kda_chunk_native, ops.kda_decode_native, ops.moe_experts_native,
        k3.situ_mul_native, k3.sigmoid_mul_native, k3.attn_res_norm_native)
