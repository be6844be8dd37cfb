"""Plain-torch reference of the cache pools' batched slot copy (`copy_slots`)."""

from __future__ import annotations

import torch


def copy_slots_ref(pool: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """pool [L, N, ...]: slot src's block copied to slot dst in every layer, for each (src,
    dst) pair (no slot both a source and a destination)."""
    for src, dst in pairs:
        pool[:, dst].copy_(pool[:, src])
