"""What every native op's wrapper asks of its tensors before a C++ call."""

from __future__ import annotations

import torch


def ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def f32(*ts: torch.Tensor) -> bool:
    """Whether every tensor is fp32 on the CPU (what the fp32 kernels take)."""
    # a plain loop: a generator in all() cost ~2 us a call, ~1.5% of a small model's step
    for t in ts:
        if t.dtype != torch.float32 or not t.is_cpu:
            return False
    return True
