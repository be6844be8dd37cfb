"""The `triton` backend: fla-core's Triton KDA kernels behind our op signatures (CUDA only).

Nothing here imports triton or fla at module import: `supports` imports them when a model is
built on a CUDA device, and the ops import them on first call.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch


def supports(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, f"triton backend needs a CUDA device, got {device.type}"
    for name in ("triton", "fla.ops.kda"):
        try:
            importlib.import_module(name)
        except Exception as e:  # an ImportError, or a triton driver error at import
            return False, f"{name} is not importable: {e}"
    return True, ""


def tile(n: int, least: int = 16, most: int = 1 << 30) -> int:
    """A power-of-two tile edge covering n (tl.arange needs powers of two), within [least,
    most]: tl.dot's operands need edges of 16 or more, hence the default least."""
    return max(least, min(most, 1 << (max(n, 1) - 1).bit_length()))


@functools.cache
def jit_module(name: str) -> Any:
    """kdaserve.kernels.triton.<name>, the module holding `@triton.jit` code, imported on a
    kernel's first call: importing it imports triton, which the CPU path never needs."""
    return importlib.import_module(f"kdaserve.kernels.triton.{name}")
