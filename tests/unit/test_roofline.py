"""The benches' cost model against a hand count on the tiny preset: FLOPs per phase (the
lm_head only for rows that produce logits) and bytes per decode step, and the weight bytes
`bench kernels` divides its times into."""

from __future__ import annotations

import pytest
import torch

from kdaserve.bench import roofline
from kdaserve.checkpoint import preset_config

# tiny: D=64, vocab 3840+256, 4 layers (KDA, KDA, KDA, MLA; dense MLP then 3 MoE), KDA 2 heads
# of 32 (P=64), conv 4; MLA 2 heads, no q LoRA, R=32, nope 16, rope 8, v 16; 8 experts of
# I=32, top-2, one shared expert; dense MLP I=128
D, VOCAB = 64, 4096
KDA_LAYER = D * (3 * 64 + 2 * 32 + 2) + 2 * 32 * 64 + 64 * D + 3 * 64 * 4
MLA_LAYER = D * 2 * 24 + D * (32 + 8) + 32 * 2 * (16 + 16) + 2 * 16 * D
EXPERT = 3 * D * 32
ROW = 3 * KDA_LAYER + MLA_LAYER + 3 * (EXPERT + D * 8) + 3 * D * 128
ACTIVE = ROW + 3 * 2 * EXPERT


def test_params_by_part() -> None:
    m = roofline.model_costs(preset_config("tiny"))
    assert m.row_params == ROW
    assert m.active_row_params == ACTIVE
    assert m.lm_head_params == D * VOCAB
    assert m.kda_flops == 3 * 2 * 7 * 32 * 32
    assert m.mla_flops_per_position == 2 * (2 * 40 + 2 * 32)
    assert m.latent_bytes == 40 * 4


def test_flops_count_the_lm_head_only_for_logits_rows() -> None:
    m = roofline.model_costs(preset_config("tiny"))
    # a 100-token prompt then 10 decode steps: 110 rows, 11 logits rows, no attention counted
    per_row = 2 * ACTIVE + 3 * 2 * 7 * 32 * 32
    assert roofline.flops(m, 110, 11) == 110 * per_row + 11 * 2 * D * VOCAB
    assert roofline.flops(m, 1, 1, attended=50) == per_row + 2 * D * VOCAB + 50 * 288


def test_decode_step_bytes() -> None:
    m = roofline.model_costs(preset_config("tiny"))
    one = 4 * (ROW + D * VOCAB + 3 * 2 * EXPERT) + 3 * 2 * 32 * 32 * 8
    assert roofline.decode_step_bytes(m, 1) == pytest.approx(one)
    # a big batch touches every expert once per layer
    many = roofline.decode_step_bytes(m, 64, distinct_experts=8, context=1000)
    assert many == 4 * (ROW + D * VOCAB + 3 * 8 * EXPERT) + 64 * 3 * 2 * 32 * 32 * 8 \
        + 1000 * 160
    assert roofline.expected_distinct_experts(m, 1) == pytest.approx(2)
    # bf16 weights: half the weight bytes, the same fp32 states
    half = 2 * (ROW + D * VOCAB + 3 * 2 * EXPERT) + 3 * 2 * 32 * 32 * 8
    assert roofline.decode_step_bytes(m, 1, bytes_per_weight=2) == pytest.approx(half)


def test_bench_kernels_weight_bytes_by_hand() -> None:
    from kdaserve.bench.kernels import _stored, weight_bytes

    w, scale = _stored(torch.randn(6, 4), "int8")
    assert weight_bytes("linear", {"weight": w, "scale": scale}) == 6 * 4 + 6 * 4  # + fp32 scales
    w, _ = _stored(torch.randn(6, 4), "bfloat16")
    assert weight_bytes("linear", {"weight": w, "scale": None}) == 6 * 4 * 2
    # 8 experts of w13 [2 x 3, 5] and w2 [5, 3] fp32; tokens route to experts 1, 2 and 6 only
    w13, w2 = torch.zeros(8, 6, 5), torch.zeros(8, 5, 3)
    ids = torch.tensor([[1, 2], [2, 6], [6, 1]])
    kw = {"w13": w13, "w2": w2, "scale13": None, "scale2": None, "ids": ids}
    assert weight_bytes("moe_experts", kw) == 3 * (6 * 5 + 5 * 3) * 4


def test_k3_costs_by_hand() -> None:
    """k3-tiny: D=64, 7 layers KKKMKMM (dense first), KDA 2 heads of 32 with the full-rank
    gate, MLA 2 heads with q LoRA 32 and the output gate, 16 experts of I=32 on a latent of
    32, top-4, two shared experts as one MLP of 64, AttnRes blocks of 3."""
    m = roofline.model_costs(preset_config("k3-tiny"))
    P, K, H = 64, 32, 2
    kda = D * (3 * P + K + P + H) + K * P + P * D + 3 * P * 4
    mla = D * 32 + 32 * 2 * 24 + D * (32 + 8) + 32 * 2 * (16 + 16) + 2 * 16 * D * 2
    moe_row = 3 * D * 32 * 2 + D * 16 + 2 * D * 32
    assert m.expert_params == 3 * 32 * 32
    assert m.row_params == 4 * kda + 3 * mla + 6 * moe_row + 3 * D * 128
    # sources per site: attention 0, 2, 2, 2, 3, 3, 3; MLP 2, 2, 2, 3, 3, 3, 4; final 4
    assert m.attn_res_sources == 15 + 19 + 4
    assert m.attn_res_flops == 6 * D * 38
    per_row = 2 * m.active_row_params + 4 * 2 * 7 * 32 * 32 + 6 * D * 38
    assert roofline.flops(m, 10, 1) == 10 * per_row + 2 * D * VOCAB
    assert roofline.decode_step_bytes(m, 2, distinct_experts=5) == 4 * (
        m.row_params + D * VOCAB + 6 * 5 * m.expert_params) + 2 * (4 * 2 * 32 * 32 * 8
                                                                   + 4 * D * 38)
