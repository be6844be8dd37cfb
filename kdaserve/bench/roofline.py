"""The machine's own limits, measured in the same run as the engine (this machine is shared and
noisy: absolute times drift, ratios measured side by side hold), and the work a model does per
token, so throughput can be put as a fraction of them."""

from __future__ import annotations

import time
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


def read_gbps(mbytes: int = 512, repeats: int = 5) -> float:
    """Best streaming-read bandwidth: a sum over a buffer much larger than the caches."""
    x = torch.ones(mbytes * 2**20 // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def model_costs(c: ModelConfig) -> dict[str, float]:
    """Parameters touched per token (active) and weight bytes read per decode step (fp32) at a
    given batch: dense weights once, each routed expert once if any token picks it."""
    D = c.hidden_size
    P, K = c.kda_dim, c.kda_head_dim
    kda = 3 * D * P + D * K + K * P + D * c.kda_num_heads + D * K + K * P + P * D
    H = c.num_attention_heads
    q = (D * H * c.qk_head_dim if c.q_lora_rank is None
         else D * c.q_lora_rank + c.q_lora_rank * H * c.qk_head_dim)
    mla = q + D * c.latent_dim + c.kv_lora_rank * H * (c.qk_nope_head_dim + c.v_head_dim) \
        + H * c.v_head_dim * D
    expert = 3 * D * c.moe_intermediate_size
    dense_mlp = 3 * D * c.intermediate_size
    attn = sum(kda if t == "kda" else mla for t in c.layer_types)
    n_moe = sum(1 for t in c.mlp_types if t == MOE)
    shared = n_moe * (expert * c.num_shared_experts + D * c.num_experts)
    dense = attn + shared + dense_mlp * (c.num_hidden_layers - n_moe) + D * c.vocab_size
    return {"dense_params": dense, "expert_params": expert, "num_moe_layers": n_moe,
            "active_params": dense + n_moe * c.num_experts_per_token * expert}


def decode_bytes_per_step(c: ModelConfig, batch: int) -> float:
    """fp32 weight bytes a decode step of `batch` sequences reads (expected distinct experts
    under uniform routing: E · (1 - (1 - k/E)^batch))."""
    m = model_costs(c)
    distinct = c.num_experts * (1 - (1 - c.num_experts_per_token / max(c.num_experts, 1)) ** batch)
    return 4 * (m["dense_params"] + m["num_moe_layers"] * distinct * m["expert_params"])


def limits() -> dict[str, Any]:
    return {"gemm_gflops": round(gemm_gflops(), 1), "read_gbps": round(read_gbps(), 2),
            "threads": torch.get_num_threads()}
