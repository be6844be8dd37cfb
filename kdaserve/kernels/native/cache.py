"""The cache pools' native op: `copy_slots`, every layer's block of a slot copied to another
in one C++ call (csrc/elementwise_cpu.cpp's copy_blocks)."""

from __future__ import annotations

import torch

from kdaserve.kernels.native.build import available, library
from kdaserve.kernels.ref.cache import copy_slots_ref


def copy_slots_native(pool: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """`copy_slots_ref`'s contract in one C++ call (a verify saves and restores a slot per
    request: two strided torch copies each were ~1 ms a step at batch 16); torch's copies
    where the layout does not allow it."""
    if not pairs:
        return
    if not pool.is_cpu or not pool.is_contiguous() or not available()[0]:
        copy_slots_ref(pool, pairs)
        return
    src = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
    size = pool.element_size()
    library().copy_blocks(pool.data_ptr(), pool.shape[0], pool.stride(0) * size,
                          pool.stride(1) * size, src.data_ptr(), dst.data_ptr(), len(pairs))
