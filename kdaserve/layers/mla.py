"""MLA layer with NoPE: the cache holds the compressed latent, attention runs weight-absorbed.
K3 adds a sigmoid output gate, `g_proj` of the layer input, on the heads' outputs."""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.config import ModelConfig
from kdaserve.forward_batch import ForwardBatch
from kdaserve.kernels import Kernels
from kdaserve.layers.linear import Linear
from kdaserve.layers.norm import RMSNorm
from kdaserve.layers.parallel import SINGLE, Destination, TensorParallel

# transformers and Moonshot's remote code build q_a/kv_a layernorms with the class default
# eps 1e-6, not rms_norm_eps; we follow the reference implementation.
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        D, H = config.hidden_size, tp.part(config.num_attention_heads, "num_attention_heads")
        self.num_heads, self.tp = H, tp
        self.dn, self.dr = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.dv = config.v_head_dim
        self.rank = config.kv_lora_rank
        if config.q_lora_rank is None:
            self.q_proj = Linear(D, H * config.qk_head_dim, kernels)
        else:
            self.q_a_proj = Linear(D, config.q_lora_rank, kernels)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS, kernels)
            self.q_b_proj = Linear(config.q_lora_rank, H * config.qk_head_dim, kernels)
        self.use_q_lora = config.q_lora_rank is not None
        self.kv_a_proj_with_mqa = Linear(D, self.rank + self.dr, kernels)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS, kernels)
        self.kv_b_proj = Linear(self.rank, H * (self.dn + self.dv), kernels)
        self.o_proj = Linear(H * self.dv, D, kernels)
        self.g_proj = Linear(D, H * self.dv, kernels) if config.mla_use_output_gate else None
        self.scale = config.qk_head_dim ** -0.5
        self.kernels = kernels

    def checkpoint_tensors(self, prefix: str) -> dict[str, Destination]:
        # per-head projections hold this rank's heads; the latent path is replicated
        split = {"q_proj.weight": 0, "q_b_proj.weight": 0, "kv_b_proj.weight": 0,
                 "g_proj.weight": 0, "o_proj.weight": 1}
        return {f"{prefix}{name}": self.tp.shard(p, split[name]) if name in split else p
                for name, p in self.named_parameters()}

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_UK [H, Dn, R] and W_UV [H, Dv, R] (views, no copy;
        the loader never narrows this weight: see `streamed_linears`)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.dn + self.dv, self.rank)
        return w[:, : self.dn], w[:, self.dn:]

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """x: [T, D]; kv_cache: [NB, BS, R + Dr] block pool of this layer."""
        T, H = x.shape[0], self.num_heads
        if self.use_q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(T, H, self.dn + self.dr)
        ckv = self.kv_a_proj_with_mqa(x)
        latent = torch.cat([self.kv_a_layernorm(ckv[:, : self.rank]), ckv[:, self.rank:]], dim=-1)
        kv_cache.view(-1, kv_cache.shape[-1])[batch.slot_mapping] = latent.to(kv_cache.dtype)
        w_uk, w_uv = self.absorbed_weights()
        o = self.kernels.mla_attention(q[..., : self.dn], q[..., self.dn:], kv_cache,
                                       batch.block_table, batch.cu_seqlens, batch.context_lens,
                                       w_uk, w_uv, self.scale, max_seqlen=batch.max_seqlen)
        o = o.reshape(T, H * self.dv)
        if self.g_proj is not None:
            o = self.kernels.sigmoid_mul(o, self.g_proj(x))
        return self.o_proj(o)
