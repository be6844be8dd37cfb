"""The machine's own limits, measured in the same run as the engine (this machine is shared and
noisy: absolute times drift, ratios measured side by side hold), and the work a model does per
token, so throughput can be put as a fraction of them."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kdaserve.config import MOE, ModelConfig


def gemm_gflops(n: int = 2048, repeats: int = 5) -> float:
    """Best fp32 GEMM throughput over a few runs of an n×n×n matmul."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def read_gbps(mbytes: int = 512, repeats: int = 9) -> float:
    """Best streaming-read bandwidth over a buffer much larger than the caches: the native
    read loop (one OpenMP team, wide loads, nothing else; each thread's share read as 1, 4, 8
    and 16 interleaved streams, the best kept: a kernel walking several weight rows at once
    read faster than one stream on a Zen 4 host), else torch's sum, whose reduction
    machinery made the probe swing by 2x between runs."""
    from kdaserve.kernels.native import build

    x = torch.ones(mbytes * 2**20 // 4)
    reads: list[Callable[[], object]]
    if build.available()[0]:
        lib = build.library()
        reads = [lambda s=s: lib.read_f32(x.data_ptr(), x.numel(), s) for s in (1, 4, 8, 16)]
    else:
        reads = [x.sum]
    best = float("inf")
    for read in reads:
        read()
        for _ in range(repeats):
            t0 = time.perf_counter()
            read()
            best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


@dataclass(frozen=True)
class ModelCosts:
    """What one token costs a model, by the part of the forward that pays it. Parameter counts
    are multiply-adds per row (2 FLOPs each, fp32: 4 bytes each when read)."""

    row_params: int  # every forwarded row: attention projections, conv, dense MLPs, routers,
    # shared experts (not the lm_head, not routed experts)
    expert_params: int  # one routed expert
    num_moe_layers: int
    top_k: int
    num_experts: int
    lm_head_params: int  # only rows that produce logits pay it
    kda_flops: int  # per row, every KDA layer's delta rule on its [H, K, V] state
    kda_state_bytes: int  # per sequence and step: fp32 states read and written, all KDA layers
    mla_flops_per_position: int  # per row and attended position, every MLA layer (absorbed)
    latent_bytes: int  # per cached position: its latents in every MLA layer (fp32)
    # K3's Attention Residuals, per row: every mixing site reads its sources (the bank's
    # filled rows and the partial sum, D values each) twice, for the scores (a dot and a
    # square sum) and for the mix: 6 FLOPs and 4 bytes (fp32 activations) per source value
    attn_res_sources: int = 0  # sources summed over the sites of one forward
    hidden_size: int = 0

    @property
    def attn_res_flops(self) -> int:
        return 6 * self.hidden_size * self.attn_res_sources

    @property
    def attn_res_bytes(self) -> int:
        return 4 * self.hidden_size * self.attn_res_sources

    @property
    def active_row_params(self) -> int:
        return self.row_params + self.num_moe_layers * self.top_k * self.expert_params


def model_costs(c: ModelConfig) -> ModelCosts:
    D, H_kda, K, V = c.hidden_size, c.kda_num_heads, c.kda_head_dim, c.kda_head_dim
    P = c.kda_dim
    # in_proj (q, k, v, f_a, the gate: K3's full-rank g_proj [P] or g_a [K], b), f_b, g_b
    # (low-rank gate only), o_proj, the short convs
    gate = P if c.kda_full_rank_gate else K
    kda = (D * (3 * P + K + gate + H_kda) + K * P + (0 if c.kda_full_rank_gate else K * P)
           + P * D + 3 * P * c.kda_conv_size)
    H = c.num_attention_heads
    q = (D * H * c.qk_head_dim if c.q_lora_rank is None
         else D * c.q_lora_rank + c.q_lora_rank * H * c.qk_head_dim)
    # kv_b_proj's W_UK / W_UV are applied per row in the absorbed form: the same count
    mla = q + D * c.latent_dim + c.kv_lora_rank * H * (c.qk_nope_head_dim + c.v_head_dim) \
        + H * c.v_head_dim * D * (2 if c.mla_use_output_gate else 1)  # o_proj, K3's g_proj
    latent = c.routed_expert_hidden_size
    # LatentMoE: routed experts work at the latent width, between a down- and an
    # up-projection every row pays; shared experts stay at the hidden width
    expert = 3 * (latent or D) * c.moe_intermediate_size
    moe_row = 3 * D * c.moe_intermediate_size * c.num_shared_experts + D * c.num_experts \
        + (2 * D * latent if latent else 0)
    n_moe = sum(1 for t in c.mlp_types if t == MOE)
    n_kda, n_mla = len(c.kda_layers), len(c.mla_layers)
    row = (n_kda * kda + n_mla * mla + n_moe * moe_row
           + 3 * D * c.intermediate_size * (c.num_hidden_layers - n_moe))
    sources = 0
    if c.attn_res_block_size:
        # the bank's filled rows at layer i's two sites (kimi_linear.py: a block's first
        # layer banks its input after the attention site), plus the partial sum; layer 0's
        # attention site has an empty bank and mixes nothing; the final site sees every block
        B, L = c.attn_res_block_size, c.num_hidden_layers
        sources = sum((-(-i // B) + 1 if i else 0) + (i // B + 2) for i in range(L)) \
            + -(-L // B) + 1
    return ModelCosts(
        row_params=row, expert_params=expert, num_moe_layers=n_moe,
        top_k=c.num_experts_per_token, num_experts=c.num_experts,
        lm_head_params=D * c.vocab_size,
        # decay (KV), k^T S (2KV), rank-1 update (2KV), read-out with q (2KV) per head
        kda_flops=n_kda * H_kda * 7 * K * V,
        kda_state_bytes=n_kda * H_kda * K * V * 4 * 2,
        # scores against latent and rope key, then the latent-weighted sum, per head
        mla_flops_per_position=n_mla * H * (2 * c.latent_dim + 2 * c.kv_lora_rank),
        latent_bytes=n_mla * c.latent_dim * 4, attn_res_sources=sources, hidden_size=D)


def flops(m: ModelCosts, rows: int, logits_rows: int, attended: int = 0) -> float:
    """FLOPs of forwarding `rows` tokens of which `logits_rows` produce logits (prefill rows
    other than a request's last do not), attending `attended` cached positions in total
    (sum over rows of each row's context; 0 leaves attention out, which only understates)."""
    return (2 * (m.active_row_params * rows + m.lm_head_params * logits_rows)
            + (m.kda_flops + m.attn_res_flops) * rows + m.mla_flops_per_position * attended)


def expected_distinct_experts(m: ModelCosts, rows: int) -> float:
    """Distinct experts per MoE layer that `rows` tokens touch under uniform routing."""
    E = max(m.num_experts, 1)
    return E * (1 - (1 - m.top_k / E) ** rows)


def decode_step_bytes(m: ModelCosts, batch: int, distinct_experts: float | None = None,
                      context: int = 0, bytes_per_weight: float = 4) -> float:
    """Bytes a decode step of `batch` sequences moves: every row weight and the lm_head once,
    each touched expert once per MoE layer (`distinct_experts`, else the uniform expectation),
    the KDA states read and written (and K3's AttnRes sources read), and `context` cached
    positions' latents read. Weights
    take `bytes_per_weight` each (2 for bf16, 1 for int8, whose fp32 row scales add 4/K);
    states and latents stay fp32 in every mode."""
    distinct = expected_distinct_experts(m, batch) if distinct_experts is None \
        else distinct_experts
    weights = m.row_params + m.lm_head_params + m.num_moe_layers * distinct * m.expert_params
    return bytes_per_weight * weights + batch * (m.kda_state_bytes + m.attn_res_bytes) \
        + context * m.latent_bytes


def limits() -> dict[str, Any]:
    return {"gemm_gflops": round(gemm_gflops(), 1), "read_gbps": round(read_gbps(), 2),
            "threads": torch.get_num_threads()}
