"""Feed-forward layers: dense SwiGLU MLP and the routed MoE with shared experts."""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.config import ModelConfig
from kdaserve.kernels import Kernels
from kdaserve.layers.linear import Linear
from kdaserve.layers.parallel import SINGLE, Destination, TensorParallel


class MLP(nn.Module):
    """SwiGLU; under tensor parallelism this rank holds `inter / tp` of the intermediate rows
    and its output is a partial sum (the caller all-reduces)."""

    def __init__(self, hidden: int, inter: int, kernels: Kernels,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        inter = tp.part(inter, "intermediate_size")
        self.inter, self.tp = inter, tp
        self.gate_up_proj = Linear(hidden, 2 * inter, kernels)  # gate rows, then up rows
        self.down_proj = Linear(inter, hidden, kernels)
        self.kernels = kernels

    def checkpoint_tensors(self, prefix: str) -> dict[str, Destination]:
        gate, up = self.gate_up_proj.weight.data.split(self.inter)
        return {f"{prefix}gate_proj.weight": self.tp.shard(gate, 0),
                f"{prefix}up_proj.weight": self.tp.shard(up, 0),
                f"{prefix}down_proj.weight": self.tp.shard(self.down_proj.weight, 1)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.kernels.silu_mul(self.gate_up_proj(x)))


class MoE(nn.Module):
    """Experts stacked as [E, 2I, D] (w1 rows then w3 rows) and [E, D, I] so kernels can batch
    them; the loader writes each checkpoint expert tensor straight into its slice. Under
    tensor parallelism every rank holds every expert's share of the intermediate rows (the
    router is replicated, so all ranks route alike) and the output is a partial sum."""

    def __init__(self, config: ModelConfig, kernels: Kernels,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        D, E = config.hidden_size, config.num_experts
        inter = tp.part(config.moe_intermediate_size, "moe_intermediate_size")
        self.config, self.tp = config, tp
        # The router runs in fp32 (as transformers does) so routing decisions do not depend on
        # the model dtype.
        self.gate_weight = nn.Parameter(torch.empty(E, D, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32))
        self.w13 = nn.Parameter(torch.empty(E, 2 * inter, D))
        self.w2 = nn.Parameter(torch.empty(E, D, inter))
        # weight-only int8: per-row fp32 scales of w13 [E, 2I] and w2 [E, D]
        self.w13_scale: torch.Tensor | None = None
        self.w2_scale: torch.Tensor | None = None
        shared = config.moe_intermediate_size * config.num_shared_experts
        self.shared_experts = MLP(D, shared, kernels, tp) if shared else None
        self.kernels = kernels

    def checkpoint_tensors(self, prefix: str) -> dict[str, Destination]:
        inter = self.w2.shape[-1]
        shard = self.tp.shard
        views: dict[str, Destination] = {
            f"{prefix}gate.weight": self.gate_weight,
            f"{prefix}gate.e_score_correction_bias": self.e_score_correction_bias}
        for e in range(self.w13.shape[0]):
            views[f"{prefix}experts.{e}.w1.weight"] = shard(self.w13.data[e, :inter], 0)
            views[f"{prefix}experts.{e}.w3.weight"] = shard(self.w13.data[e, inter:], 0)
            views[f"{prefix}experts.{e}.w2.weight"] = shard(self.w2.data[e], 1)
        if self.shared_experts is not None:
            views.update(self.shared_experts.checkpoint_tensors(f"{prefix}shared_experts."))
        return views

    def forward(self, x: torch.Tensor, routing: list[torch.Tensor] | None = None) -> torch.Tensor:
        """`routing`: if a list, the chosen experts [T, k] are appended (routing replay)."""
        c = self.config
        logits = self.kernels.linear(x.float(), self.gate_weight)
        weights, ids = self.kernels.moe_route(
            logits, self.e_score_correction_bias, c.num_experts_per_token, c.num_expert_group,
            c.topk_group, c.moe_renormalize, c.routed_scaling_factor, c.router_activation)
        if routing is not None:
            routing.append(ids.to(torch.int32))
        y = self.kernels.moe_experts(x, weights, ids, self.w13, self.w2, self.w13_scale,
                                     self.w2_scale)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y
