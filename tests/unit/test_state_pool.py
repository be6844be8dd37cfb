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
