"""Plain-torch reference of the dense SwiGLU activation."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up = [..., gate | up] (the SwiGLU of a dense MLP)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
