"""StatePool's batched slot copy against the one-slot copy."""

from __future__ import annotations

import pytest
import torch

from kdaserve.cache.state_pool import StatePool
from kdaserve.checkpoint import preset_config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("logged", [False, True])  # logged (tensor parallel): torch copies
def test_copy_many_equals_one_copy_per_pair(dtype: torch.dtype, logged: bool) -> None:
    config = preset_config("small")
    g = torch.Generator().manual_seed(0)
    a = StatePool(config, 9, dtype)
    a.recurrent.copy_(torch.randn(a.recurrent.shape, generator=g))
    a.conv.copy_(torch.randn(a.conv.shape, generator=g).to(dtype))
    b = StatePool(config, 9, dtype)
    b.recurrent.copy_(a.recurrent)
    b.conv.copy_(a.conv)
    pairs = [(0, 5), (3, 8), (7, 1)]
    if logged:
        b.log = []
    b.copy_many(pairs)
    for src, dst in pairs:
        a.copy(src, dst)
    assert torch.equal(a.recurrent, b.recurrent) and torch.equal(a.conv, b.conv)
    assert b.log == ([("copy", s, d) for s, d in pairs] if logged else None)
    assert not torch.equal(a.recurrent[:, 0], a.recurrent[:, 2])  # the data were distinct


def test_state_pool_copies_through_the_registry() -> None:
    """The pool's batched copy is the `copy_slots` op its device resolves (native on a CPU
    with the library, else the reference), and every backend copies as the reference does."""
    from kdaserve.kernels import registry
    from kdaserve.kernels.ref.cache import copy_slots_ref

    pool = StatePool(preset_config("small"), 4, torch.float32)
    assert pool._copy_slots is registry.resolve("copy_slots", torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    for backend in registry.backends("copy_slots"):
        if not backend.supports(torch.device("cpu"))[0]:
            continue
        want = torch.randn(3, 6, 2, 5, generator=g)
        got = want.clone()
        backend.fn(got, [(0, 4), (2, 1)])
        copy_slots_ref(want, [(0, 4), (2, 1)])
        assert torch.equal(got, want), backend.name
        backend.fn(got[:, :, 1], [(3, 5)])  # a strided view: the native one falls back
        copy_slots_ref(want[:, :, 1], [(3, 5)])
        assert torch.equal(got, want), backend.name
