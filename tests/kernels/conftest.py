"""fla's naive KDA functions, loaded from their file so that `fla.ops` (which needs triton) is
never imported: naive.py is pure torch + einops."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch


@pytest.fixture(scope="session")
def fla_naive() -> ModuleType:
    spec = importlib.util.find_spec("fla")
    if spec is None or spec.origin is None:
        pytest.skip("fla-core is not installed")
    path = Path(spec.origin).parent / "ops" / "kda" / "naive.py"
    mspec = importlib.util.spec_from_file_location("_fla_kda_naive", path)
    assert mspec is not None and mspec.loader is not None
    module = importlib.util.module_from_spec(mspec)
    mspec.loader.exec_module(module)
    return module


def spy_on_native_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the native library's functions called from now on (in order)."""
    from kdaserve.kernels.native import ops

    calls: list[str] = []
    real = ops.library

    class Spy:
        def __getattr__(self, name: str):  # noqa: ANN204
            calls.append(name)
            return getattr(real(), name)

    monkeypatch.setattr(ops, "library", Spy)
    return calls


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per output: the split's 2^-17 relative error on each activation, plus fp32 sums over
    K terms, as a multiple of sum_k |x_k w_k|."""
    K = x.shape[1]
    return (2.0**-16 + K * 2.0**-23) * (x.double().abs() @ w.double().abs().t())


def make_inputs(lengths: list[int], seed: int = 0, strong_decay: bool = False,
                H: int = 2, K: int = 16, V: int = 16):  # noqa: ANN201, N803
    """Random KDA inputs for sequences of `lengths` (test_kda.py's H, K, V by default)."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q = torch.randn(T, H, K, generator=g)
    k = torch.randn(T, H, K, generator=g)
    v = torch.randn(T, H, V, generator=g)
    f = torch.randn(T, H, K, generator=g) * (4.0 if strong_decay else 1.0)
    beta = torch.randn(T, H, generator=g)
    A_log = torch.rand(H, generator=g) * 2.0
    dt_bias = torch.randn(H * K, generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return q, k, v, f, beta, A_log, dt_bias, cu
