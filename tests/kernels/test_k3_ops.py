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
from kdaserve.kernels.ref.mlp import situ_mul_ref

from .test_kda import make_inputs

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
