"""KDA (Kimi Delta Attention) layer: projections, short conv, gates, delta rule, gated norm.

Parameters keep Moonshot's checkpoint names; the three depthwise conv kernels are stored fused as
one [3P, W] weight because the short conv runs once over the concatenated q|k|v projections.
"""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.config import ModelConfig
from kdaserve.forward_batch import ForwardBatch
from kdaserve.kernels import Kernels
from kdaserve.kernels.ref.kda import gated_rmsnorm
from kdaserve.layers.linear import Linear


class KDAttention(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels) -> None:
        super().__init__()
        D, H, K = config.hidden_size, config.kda_num_heads, config.kda_head_dim
        P = H * K
        self.num_heads, self.head_dim, self.eps = H, K, config.rms_norm_eps
        self.q_proj = Linear(D, P, kernels)
        self.k_proj = Linear(D, P, kernels)
        self.v_proj = Linear(D, P, kernels)
        self.conv_weight = nn.Parameter(torch.empty(3 * P, config.kda_conv_size))
        self.f_a_proj = Linear(D, K, kernels)
        self.f_b_proj = Linear(K, P, kernels)
        self.b_proj = Linear(D, H, kernels)
        self.g_a_proj = Linear(D, K, kernels)
        self.g_b_proj = Linear(K, P, kernels)
        self.o_norm_weight = nn.Parameter(torch.ones(K))
        self.o_proj = Linear(P, D, kernels)
        # Decay parameters stay fp32 whatever the model dtype (as in the checkpoint).
        self.A_log = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(P, dtype=torch.float32))
        self.kernels = kernels

    def checkpoint_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Checkpoint name -> destination view for every tensor of this layer."""
        P, W = self.conv_weight.shape[0] // 3, self.conv_weight.shape[1]
        views = {
            f"{prefix}{name}.weight": getattr(self, name).weight
            for name in ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj",
                         "g_a_proj", "g_b_proj", "o_proj")
        }
        for i, name in enumerate(("q_conv1d", "k_conv1d", "v_conv1d")):
            views[f"{prefix}{name}.weight"] = self.conv_weight.data[i * P:(i + 1) * P].view(P, 1, W)
        views[f"{prefix}o_norm.weight"] = self.o_norm_weight
        views[f"{prefix}A_log"] = self.A_log.data.view(1, 1, -1, 1)
        views[f"{prefix}dt_bias"] = self.dt_bias
        return views

    def forward(self, x: torch.Tensor, batch: ForwardBatch, recurrent_state: torch.Tensor,
                conv_state: torch.Tensor) -> torch.Tensor:
        """x: [T, D]; recurrent_state: [N, H, K, V] fp32 pool; conv_state: [N, W-1, 3P] pool."""
        T, H, K = x.shape[0], self.num_heads, self.head_dim
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        f = self.f_b_proj(self.f_a_proj(x)).view(T, H, K)
        beta = self.b_proj(x)
        z = self.g_b_proj(self.g_a_proj(x)).view(T, H, K)
        if batch.is_decode:
            o = self.kernels.kda_decode(qkv, f, beta, z, self.conv_weight, self.A_log,
                                        self.dt_bias, self.o_norm_weight, self.eps,
                                        recurrent_state, conv_state, batch.state_slots)
            return self.o_proj(o.reshape(T, H * K))
        qkv = self.kernels.short_conv(qkv, self.conv_weight, conv_state, batch.state_slots,
                                      batch.cu_seqlens)
        q, k, v = (t.view(T, H, K) for t in qkv.chunk(3, dim=-1))
        o = self.kernels.kda_chunk(q, k, v, f, beta, self.A_log, self.dt_bias, recurrent_state,
                                   batch.state_slots, batch.cu_seqlens)
        o = gated_rmsnorm(o, z, self.o_norm_weight, self.eps)
        return self.o_proj(o.reshape(T, H * K))
