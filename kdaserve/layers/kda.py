"""KDA (Kimi Delta Attention) layer: projections, short conv, gates, delta rule, gated norm.

Parameters keep Moonshot's checkpoint names; the three depthwise conv kernels are stored fused as
one [3P, W] weight because the short conv runs once over the concatenated q|k|v projections.
K3's variant (k3_spec.md 4.5) differs in two places: the decay is lower-bounded (the KDA ops'
`lower_bound`) and the output gate is one full-rank projection `g_proj` instead of g_a/g_b.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from kdaserve.config import ModelConfig
from kdaserve.forward_batch import ForwardBatch
from kdaserve.kernels import Kernels
from kdaserve.layers.linear import Linear
from kdaserve.layers.parallel import SINGLE, Destination, Prefix, TensorParallel
from kdaserve.step_record import KDASteps

# New tokens per sequence up to which a batch runs the fused decode step token by token
# (speculative verifies) instead of the prefill ops (short conv, chunk scan, norm), whose
# fixed cost per op dominates a few tokens
FUSED_MAX_TOKENS = 16


class KDAttention(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        # under tensor parallelism this rank holds H of the heads (and their states)
        D, H, K = config.hidden_size, tp.part(config.kda_num_heads, "kda_num_heads"), \
            config.kda_head_dim
        P = H * K
        self.tp = tp
        self.num_heads, self.head_dim, self.eps = H, K, config.rms_norm_eps
        # Every projection of the layer input in one weight, rows q | k | v | f_a | g_a | b
        # (K3: g_proj's P rows in g_a's place): one pass over x (one GEMV per decode step
        # instead of six), and q|k|v come out already concatenated for the short conv.
        self.full_rank_gate = config.kda_full_rank_gate
        self.in_split = (3 * P, K, P if self.full_rank_gate else K, H)
        self.in_proj = Linear(D, sum(self.in_split), kernels)
        self.conv_weight = nn.Parameter(torch.empty(3 * P, config.kda_conv_size))
        self.f_b_proj = Linear(K, P, kernels)
        self.g_b_proj = None if self.full_rank_gate else Linear(K, P, kernels)
        self.o_norm_weight = nn.Parameter(torch.ones(K))
        self.o_proj = Linear(P, D, kernels)
        # Decay parameters stay fp32 whatever the model dtype (as in the checkpoint).
        self.A_log = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(P, dtype=torch.float32))
        self.kernels = kernels
        self.kda_chunk, self.kda_decode = kernels.kda_chunk, kernels.kda_decode
        bound = config.kda_gate_lower_bound
        if bound is not None:
            if "kda_lower_bound" not in kernels.features:
                raise ValueError("K3's lower-bounded KDA gate needs kernels resolved with the "
                                 "'kda_lower_bound' feature (ModelConfig.kernel_features)")
            self.kda_chunk = partial(kernels.kda_chunk, lower_bound=bound)
            self.kda_decode = partial(kernels.kda_decode, lower_bound=bound)
        self.k3_layout = bound is not None or self.full_rank_gate

    def checkpoint_tensors(self, prefix: str) -> dict[str, Destination]:
        """Checkpoint name -> destination view for every tensor of this layer (this rank's
        slice of the per-head ones under tensor parallelism)."""
        P, W = self.conv_weight.shape[0] // 3, self.conv_weight.shape[1]
        shard = self.tp.shard
        views: dict[str, Destination] = {
            f"{prefix}f_b_proj.weight": shard(self.f_b_proj.weight, 0),
            f"{prefix}o_proj.weight": shard(self.o_proj.weight, 1)}
        if self.g_b_proj is not None:
            views[f"{prefix}g_b_proj.weight"] = shard(self.g_b_proj.weight, 0)
        gate = "g_proj" if self.full_rank_gate else "g_a_proj"
        rows = self.in_proj.weight.data.split((P, P, P, *self.in_split[1:]))
        for name, w in zip(("q_proj", "k_proj", "v_proj", "f_a_proj", gate, "b_proj"),
                           rows, strict=True):  # f_a and g_a are low-rank: replicated
            views[f"{prefix}{name}.weight"] = w if name in ("f_a_proj", "g_a_proj") \
                else shard(w, 0)
        for i, name in enumerate(("q_conv1d", "k_conv1d", "v_conv1d")):
            views[f"{prefix}{name}.weight"] = shard(
                self.conv_weight.data[i * P:(i + 1) * P].view(P, 1, W), 0)
        views[f"{prefix}o_norm.weight"] = self.o_norm_weight
        # Kimi Linear stores A_log [1, 1, H, 1]; K3 a vector of which the first H entries are
        # used (stored [128] for 96 heads; written here as long as a head is wide)
        tp = self.tp
        stored = max(self.head_dim, self.num_heads * tp.size)
        views[f"{prefix}A_log"] = Prefix(self.A_log.data, 0, tp.rank, tp.size, stored) \
            if self.k3_layout else shard(self.A_log.data.view(1, 1, -1, 1), 2)
        views[f"{prefix}dt_bias"] = shard(self.dt_bias, 0)
        return views

    def forward(self, x: torch.Tensor, batch: ForwardBatch, recurrent_state: torch.Tensor,
                conv_state: torch.Tensor) -> torch.Tensor:
        """x: [T, D]; recurrent_state: [N, H, K, V] fp32 pool; conv_state: [N, W-1, 3P] pool."""
        T, H, K = x.shape[0], self.num_heads, self.head_dim
        qkv, f_a, g, beta = self.in_proj(x).split(self.in_split, dim=-1)
        f = self.f_b_proj(f_a).view(T, H, K)
        z = (g if self.g_b_proj is None else self.g_b_proj(g)).reshape(T, H, K)
        if batch.is_decode or (0 < batch.max_seqlen <= FUSED_MAX_TOKENS
                               and batch.snapshots is None):
            # a few tokens per sequence (a verify): the fused step token by token, the same
            # arithmetic as that many decodes, and no per-op overhead of the prefill path
            if batch.record is not None:
                batch.record.add(qkv, f, beta)
            o = self.kda_decode(qkv, f, beta, z, self.conv_weight, self.A_log,
                                        self.dt_bias, self.o_norm_weight, self.eps,
                                        recurrent_state, conv_state, batch.state_slots,
                                        None if batch.is_decode else batch.cu_seqlens)
            return self.o_proj(o.reshape(T, H * K))
        pre = qkv
        snapshots = None
        if batch.snapshots is not None:
            # conv windows at the snapshot positions, from the windows before this chunk (the
            # short conv overwrites them); the recurrent states come from kda_chunk itself
            seqs, n, dst = batch.snapshots
            starts = batch.cu_seqlens[seqs]
            conv_state[dst] = conv_windows(conv_state[batch.state_slots[seqs]], pre, starts, n)
            snapshots = (starts + n - 1, dst)
        qkv = self.kernels.short_conv(qkv, self.conv_weight, conv_state, batch.state_slots,
                                      batch.cu_seqlens)
        q, k, v = (t.view(T, H, K) for t in qkv.chunk(3, dim=-1))
        if batch.record is not None:  # a verify forward: keep the steps for the rollback
            batch.record.add(pre, f, beta)
        o = self.kda_chunk(q, k, v, f, beta, self.A_log, self.dt_bias, recurrent_state,
                                   batch.state_slots, batch.cu_seqlens,
                                   snapshots=snapshots)
        o = self.kernels.gated_rmsnorm(o, z, self.o_norm_weight, self.eps)
        return self.o_proj(o.reshape(T, H * K))

    def replay_steps(self, steps: KDASteps, cu_seqlens: torch.Tensor, state_slots: torch.Tensor,
                     recurrent_state: torch.Tensor, conv_state: torch.Tensor) -> None:
        """Advances the states of `state_slots` (conv windows restored to before the verify)
        by recorded steps (packed, `cu_seqlens` [B+1]) through the fused step, token by token,
        discarding its outputs: for a verify that ran the fused step, its states bit for bit."""
        H, V = self.num_heads, self.head_dim
        self.kda_decode(steps.qkv, steps.f, steps.beta,
                                steps.f.new_zeros(steps.f.shape[0], H, V), self.conv_weight,
                                self.A_log, self.dt_bias, self.o_norm_weight, self.eps,
                                recurrent_state, conv_state, state_slots, cu_seqlens)


def conv_windows(old: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
                 n: torch.Tensor) -> torch.Tensor:
    """The short-conv windows [S, W-1, C] after n[s] more inputs: the last W-1 rows of
    [old[s] ; rows[starts[s] : starts[s] + n[s]]] (old windows first, then packed rows)."""
    S, W1 = old.shape[0], old.shape[1]
    # row i of the new window is row n + i of [old window ; new rows]: gathered from each
    # side and chosen per row (concatenating the two copied every packed row of the chunk,
    # ~19 MB a layer for a 2,048-token `bench` step, only to read S * (W-1) of them)
    pos = n[:, None] + torch.arange(W1, device=n.device)
    from_old = old[torch.arange(S, device=n.device)[:, None], pos.clamp(max=W1 - 1)]
    from_new = rows[(starts[:, None] + pos - W1).clamp(min=0)].to(old.dtype)
    return torch.where((pos < W1)[..., None], from_old, from_new)
