"""Plain-torch references of the gated activations: SwiGLU (Kimi Linear), SiTU-GLU (K3) and
the sigmoid gate of K3's MLA output."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up = [..., gate | up] (the SwiGLU of a dense MLP)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def situ_mul_ref(gate_up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """K3's SiTU-GLU on gate_up = [..., gate | up], in fp32 and cast back (k3_spec.md 4.3):
    beta * tanh(gate / beta) * sigmoid(gate), a SiLU whose positive side is soft-capped at
    beta, times the up branch soft-capped at linear_beta (uncapped when None)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    a = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    if linear_beta is not None:
        up = linear_beta * torch.tanh(up / linear_beta)
    return (a * up).to(gate_up.dtype)


def sigmoid_mul_ref(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate), elementwise (K3's MLA output gate on the heads' outputs)."""
    return x * torch.sigmoid(gate)
