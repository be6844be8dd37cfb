"""Feed-forward layers: dense gated MLP and the routed MoE with shared experts.

The gate activation is SwiGLU (Kimi Linear) or SiTU-GLU (K3, `config.hidden_act == "situ"`).
K3's MoE is a LatentMoE: the routed experts run at a latent width, between a down-projection
of the input and an RMSNorm + up-projection of their weighted sum (k3_spec.md 4.4).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from kdaserve.config import ModelConfig
from kdaserve.hub_schema import MXFP4_GROUP
from kdaserve.kernels import Kernels
from kdaserve.layers.linear import Linear
from kdaserve.layers.norm import RMSNorm
from kdaserve.layers.parallel import (
    SINGLE,
    SINGLE_EP,
    Destination,
    ExpertParallel,
    TensorParallel,
)


def situ_of(config: ModelConfig) -> tuple[float, float | None] | None:
    """(beta, linear_beta) of a SiTU-GLU model, None for SwiGLU."""
    return (config.situ_beta, config.situ_linear_beta) if config.hidden_act == "situ" else None


class MLP(nn.Module):
    """SwiGLU, or SiTU-GLU with `situ = (beta, linear_beta)`; under tensor parallelism this
    rank holds `inter / tp` of the intermediate rows and its output is a partial sum (the
    caller all-reduces)."""

    def __init__(self, hidden: int, inter: int, kernels: Kernels,
                 tp: TensorParallel = SINGLE,
                 situ: tuple[float, float | None] | None = None) -> None:
        super().__init__()
        inter = tp.part(inter, "intermediate_size")
        self.inter, self.tp = inter, tp
        self.gate_up_proj = Linear(hidden, 2 * inter, kernels)  # gate rows, then up rows
        self.down_proj = Linear(inter, hidden, kernels)
        self.kernels = kernels
        self.act = kernels.silu_mul if situ is None else partial(kernels.situ_mul, beta=situ[0],
                                                                 linear_beta=situ[1])

    def checkpoint_tensors(self, prefix: str) -> dict[str, Destination]:
        gate, up = self.gate_up_proj.weight.data.split(self.inter)
        return {f"{prefix}gate_proj.weight": self.tp.shard(gate, 0),
                f"{prefix}up_proj.weight": self.tp.shard(up, 0),
                f"{prefix}down_proj.weight": self.tp.shard(self.down_proj.weight, 1)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class MoE(nn.Module):
    """Experts stacked as [E, 2I, D] (w1 rows then w3 rows) and [E, D, I] so kernels can batch
    them; the loader writes each checkpoint expert tensor straight into its slice. Under
    tensor parallelism every rank holds every expert's share of the intermediate rows (the
    router is replicated, so all ranks route alike) and the output is a partial sum. Under
    expert parallelism (DP attention) a rank holds whole experts, `ep.experts(E)`, and serves
    every rank's tokens routed to them (see `ExpertParallel`)."""

    def __init__(self, config: ModelConfig, kernels: Kernels,
                 tp: TensorParallel = SINGLE, ep: ExpertParallel = SINGLE_EP) -> None:
        super().__init__()
        if tp.size > 1 and ep.size > 1:
            raise ValueError("tensor and expert parallelism together are not supported yet")
        latent = config.routed_expert_hidden_size
        D = config.hidden_size
        # LatentMoE: the experts see (and sum) the input projected to the latent width. The
        # down-projection and the norm are replicated; under tensor parallelism the latent
        # sums are all-reduced before the norm (each rank's experts hold a share of the
        # intermediate rows), and the up-projection is row-parallel over the latent, so the
        # MoE's output stays a partial sum like every other TP layer's.
        self.down_proj = Linear(D, latent, kernels) if latent is not None else None
        self.latent_norm = RMSNorm(latent, config.rms_norm_eps, kernels) \
            if latent is not None and config.latent_moe_use_norm else None
        self.up_proj = Linear(tp.part(latent, "routed_expert_hidden_size"), D, kernels) \
            if latent is not None else None
        Dx = latent or D  # the experts' input width
        self.local = ep.experts(config.num_experts)
        E = len(self.local)  # experts held here (the router sees all of them)
        inter = tp.part(config.moe_intermediate_size, "moe_intermediate_size")
        self.config, self.tp, self.ep = config, tp, ep
        # The router runs in fp32 (as transformers does) so routing decisions do not depend on
        # the model dtype.
        n = config.num_experts
        self.gate_weight = nn.Parameter(torch.empty(n, D, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        shared = config.moe_intermediate_size * config.num_shared_experts
        # One shared expert as wide as a routed one can ride in the experts kernel as expert
        # E (see Kernels.fuse_shared_expert); under expert parallelism each rank runs it on
        # its own tokens, outside the routed exchange, so it stays a dense MLP there.
        self.mxfp4 = config.expert_format == "mxfp4"
        self.shared_slot = E if (kernels.fuse_shared_expert and config.num_shared_experts == 1
                                 and ep.size == 1 and latent is None and not self.mxfp4) else None
        rows = E + (self.shared_slot is not None)
        if self.mxfp4:
            # held as shipped (kernels/ref/mxfp4.py): codes two to a byte along the input,
            # an E8M0 scale per 32 inputs; a TP rank's share of the intermediate rows must
            # keep whole scale groups in w2
            if inter % MXFP4_GROUP:
                raise ValueError(f"MXFP4 experts: moe_intermediate_size / tp_size = {inter} "
                                 f"is not a multiple of {MXFP4_GROUP}")
            self.w13 = nn.Parameter(torch.empty(rows, 2 * inter, Dx // 2, dtype=torch.uint8),
                                    requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(rows, Dx, inter // 2, dtype=torch.uint8),
                                   requires_grad=False)
            self.register_buffer("w13_scale", torch.empty(
                rows, 2 * inter, Dx // MXFP4_GROUP, dtype=torch.uint8), persistent=False)
            self.register_buffer("w2_scale", torch.empty(
                rows, Dx, inter // MXFP4_GROUP, dtype=torch.uint8), persistent=False)
        else:
            self.w13 = nn.Parameter(torch.empty(rows, 2 * inter, Dx))
            self.w2 = nn.Parameter(torch.empty(rows, Dx, inter))
            # weight-only int8: per-row fp32 scales of w13 [E, 2I] and w2 [E, D]
            self.w13_scale: torch.Tensor | None = None
            self.w2_scale: torch.Tensor | None = None
        situ = situ_of(config)
        self.shared_experts = MLP(D, shared, kernels, tp, situ) \
            if shared and self.shared_slot is None else None
        self.kernels = kernels
        self.moe_experts = kernels.moe_experts
        if situ is not None:
            if "situ" not in kernels.features:
                raise ValueError("SiTU-GLU experts need kernels resolved with the 'situ' "
                                 "feature (ModelConfig.kernel_features)")
            self.moe_experts = partial(kernels.moe_experts, situ=situ)

    def checkpoint_tensors(self, prefix: str) -> dict[str, Destination | None]:
        """None: an expert another rank holds (in the checkpoint, not read here)."""
        inter = self.w13.shape[1] // 2
        shard = self.tp.shard
        views: dict[str, Destination | None] = {
            f"{prefix}gate.weight": self.gate_weight,
            f"{prefix}gate.e_score_correction_bias": self.e_score_correction_bias}
        for name, m in (("routed_expert_down_proj", self.down_proj),
                        ("routed_expert_norm", self.latent_norm),
                        ("routed_expert_up_proj", self.up_proj)):
            if m is not None:
                views[f"{prefix}{name}.weight"] = self.tp.shard(m.weight, 1) \
                    if m is self.up_proj else m.weight
        # MXFP4: each weight as its packed codes and its scales, sliced alike
        parts = [("weight_packed", self.w13.data, self.w2.data),
                 ("weight_scale", self.w13_scale, self.w2_scale)] if self.mxfp4 else \
            [("weight", self.w13.data, self.w2.data)]
        for e in range(self.config.num_experts):
            for suffix, w13, w2 in parts:
                names = [f"{prefix}experts.{e}.{w}.{suffix}" for w in ("w1", "w3", "w2")]
                if e not in self.local:
                    views.update(dict.fromkeys(names))
                    continue
                i = e - self.local.start
                assert w13 is not None and w2 is not None
                views[names[0]] = shard(w13[i, :inter], 0)
                views[names[1]] = shard(w13[i, inter:], 0)
                views[names[2]] = shard(w2[i], 1)
        if self.shared_experts is not None:
            views.update(self.shared_experts.checkpoint_tensors(f"{prefix}shared_experts."))
        elif self.shared_slot is not None:
            s = f"{prefix}shared_experts."
            views[f"{s}gate_proj.weight"] = shard(self.w13.data[self.shared_slot, :inter], 0)
            views[f"{s}up_proj.weight"] = shard(self.w13.data[self.shared_slot, inter:], 0)
            views[f"{s}down_proj.weight"] = shard(self.w2.data[self.shared_slot], 1)
        return views

    def _latent_out(self, y: torch.Tensor) -> torch.Tensor:
        """LatentMoE's experts' latent sum [T, latent] -> the MoE's routed output [T, D]
        (this rank's partial sum under tensor parallelism)."""
        tp = self.tp
        y = tp.all_reduce(y)
        if self.latent_norm is not None:
            y = self.latent_norm(y)
        if tp.size > 1:
            n = y.shape[1] // tp.size
            y = y[:, tp.rank * n:(tp.rank + 1) * n].contiguous()
        assert self.up_proj is not None
        return self.up_proj(y)

    def routed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """w13 and w2 of the routed experts held here (without a fused shared expert)."""
        n = len(self.local)
        return self.w13.data[:n], self.w2.data[:n]

    def forward(self, x: torch.Tensor, routing: list[torch.Tensor] | None = None) -> torch.Tensor:
        """`routing`: if a list, the chosen experts [T, k] are appended (routing replay)."""
        c = self.config
        ep = self.ep
        xs, sizes = ep.gather(x) if ep.size > 1 else (x, [x.shape[0]])
        if xs.shape[0]:
            weights, ids = self.kernels.moe_route(
                self.kernels.linear(xs.float(), self.gate_weight),
                self.e_score_correction_bias, c.num_experts_per_token, c.num_expert_group,
                c.topk_group, c.moe_renormalize, c.routed_scaling_factor, c.router_activation)
        else:  # an idle rank's step (every rank idle): nothing routed
            weights = xs.new_zeros(0, c.num_experts_per_token, dtype=torch.float32)
            ids = torch.zeros(0, c.num_experts_per_token, dtype=torch.int64)
        if ep.size == 1:
            if routing is not None:
                routing.append(ids.to(torch.int32))
            if self.shared_slot is not None:
                T = x.shape[0]
                weights = torch.cat((weights, weights.new_ones(T, 1)), 1)
                ids = torch.cat((ids, ids.new_full((T, 1), self.shared_slot)), 1)
            if self.down_proj is not None:
                y = self._latent_out(self.moe_experts(
                    self.down_proj(x), weights, ids, self.w13, self.w2, self.w13_scale,
                    self.w2_scale))
            else:
                y = self.moe_experts(x, weights, ids, self.w13, self.w2, self.w13_scale,
                                     self.w2_scale)
        else:
            first = sum(sizes[:ep.rank])
            if routing is not None:
                routing.append(ids[first:first + x.shape[0]].to(torch.int32))
            # LatentMoE: every rank projects the gathered rows (the router needs them at
            # full width); the combined latent sums of this rank's rows are then finished here
            y = ep.combine(self._local_experts(
                xs if self.down_proj is None else self.down_proj(xs), weights, ids), sizes)
            if self.down_proj is not None:
                y = self._latent_out(y)
        if self.shared_experts is not None and x.shape[0]:
            y = y + self.shared_experts(x)
        return y

    def _local_experts(self, xs: torch.Tensor, weights: torch.Tensor,
                       ids: torch.Tensor) -> torch.Tensor:
        """The token-expert pairs routed to this rank's experts, each pair as its own row
        (top-1 with its routing weight), summed back per token: no work for the others."""
        lo, n = self.local.start, len(self.local)
        tok, slot = ((ids >= lo) & (ids < lo + n)).nonzero(as_tuple=True)
        y = torch.zeros_like(xs)
        if tok.numel():
            part = self.moe_experts(
                xs[tok].contiguous(), weights[tok, slot][:, None].contiguous(),
                (ids[tok, slot] - lo)[:, None].contiguous(), self.w13, self.w2,
                self.w13_scale, self.w2_scale)
            y.index_add_(0, tok, part)
        return y
