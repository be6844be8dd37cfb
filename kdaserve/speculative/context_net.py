"""Kimi K3's published block drafters, as networks: Inferact's DSpark (MLA draft attention,
vLLM's `K3DSparkModel`), RadixArk's DSpark (GQA, SGLang's `DSparkDraftModel`) and DFlash
(`DFlashDraftModel`). k3_spec.md 7, and the notes from vLLM's and SGLang's loaders in
docs/speculative.md, "K3's drafters".

All three read the target's hidden states at a few layers ("taps") for every committed
position, project them once, c = norm(fc([tap_1; ...; tap_n])), and give each draft layer keys
and values from c: the context enters attention only (no query, no MLP). A draft step runs a
block of N rows, the pending token (the "anchor") then N - 1 mask tokens, embedded by the
target's embedding at positions P..P+N-1 (P: the context's length). Every block row attends to
the whole context and to the whole block (non-causal); pre-norm layers, SiLU-GLU MLPs; the
drafter's own final norm; the target's lm_head gives the logits.

- DSpark: row i predicts the token after position P + i (N drafts); a sequential Markov head
  adds markov_w2 markov_w1[prev] to row i's logits (prev: the anchor, then the last draft), and
  a confidence head sigmoid(proj([h_i; markov_w1[prev_i]])) predicts each draft's survival.
- DFlash: row i >= 1 predicts the token at its own position (N - 1 drafts), no heads.

Layers (tensor names as the checkpoints store them, no `model.` prefix):
- GQA (RadixArk's DSpark, DFlash; Qwen3-style): self_attn.{q,k,v,o}_proj, per-head RMSNorms
  q_norm / k_norm before RoPE (NeoX halves), scale head_dim^-1/2.
- MLA (Inferact's DSpark; DeepSeek-style, no output gate): q_a_proj -> q_a_layernorm -> q_b_proj
  ([nope | rope] per head); kv_a_proj_with_mqa -> [latent | k_pe], kv_a_layernorm on the
  latent, kv_b_proj -> [k_nope | v] per head; RoPE interleaved (GPT-J pairs) on q_pe and k_pe,
  scale (nope + rope)^-1/2. The cache holds [normed latent | roped k_pe] per position.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from kdaserve.kernels import silu_mul_ref
from kdaserve.layers.norm import RMSNorm


@dataclass(frozen=True)
class DrafterFormat:
    """What tells the published formats apart."""

    name: str  # make-block-drafter --format
    architecture: str  # config.json architectures[0]
    attention: str  # "mla" or "gqa"
    dspark: bool  # a Markov head and a confidence head; rows predict the next position
    tap_stream: str  # ForwardBatch.tap_stream of the target: "partial" or "aggregated"
    fc: str  # the taps' projection and its norm, the final norm: their tensor names
    fc_norm: str
    final_norm: str

    @property
    def first_draft_row(self) -> int:
        """DSpark's row 0 (the anchor) predicts the next token; DFlash's row i its own."""
        return 0 if self.dspark else 1


FORMATS = {f.name: f for f in (
    # vLLM taps the raw AttnRes partial sums for Inferact's drafter (k3_spec.md 7.1)
    DrafterFormat("k3-dspark-mla", "K3DSparkModel", "mla", True, "partial",
                  "context_proj", "context_norm", "final_norm"),
    # SGLang taps the aggregated stream for RadixArk's (k3_spec.md 7.2) and, with its open
    # DFlash-on-K3 change, for DFlash too (an alias of the DSpark capture)
    DrafterFormat("k3-dspark-gqa", "DSparkDraftModel", "gqa", True, "aggregated",
                  "fc", "hidden_norm", "norm"),
    DrafterFormat("dflash", "DFlashDraftModel", "gqa", False, "aggregated",
                  "fc", "hidden_norm", "norm"),
)}
BY_ARCHITECTURE = {f.architecture: f for f in FORMATS.values()}


@dataclass(frozen=True)
class Rope:
    """RoPE's frequencies: the default (theta^(-2i/d)), or DeepSeek's YaRN as vLLM applies it
    to MLA (`factor` > 1): frequencies blended between interpolated and extrapolated by a ramp
    over [beta_fast, beta_slow] rotations of the original context, cos and sin scaled by
    m(mscale) / m(mscale_all_dim), the attention scale by m(mscale_all_dim)^2, where
    m(s) = 0.1 s ln(factor) + 1."""

    theta: float
    factor: float = 1.0
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def _m(self, s: float) -> float:
        return 0.1 * s * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

    def inv_freq(self, d: int) -> torch.Tensor:
        base = self.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        if self.factor <= 1:
            return 1.0 / base

        def dim_of(rotations: float) -> float:
            return d * math.log(self.original_max_position / (rotations * 2 * math.pi)) \
                / (2 * math.log(self.theta))

        lo = max(math.floor(dim_of(self.beta_fast)), 0)
        hi = min(math.ceil(dim_of(self.beta_slow)), d - 1)
        ramp = ((torch.arange(d // 2, dtype=torch.float32) - lo) / max(hi - lo, 0.001)).clamp(0, 1)
        keep = 1 - ramp  # 1: extrapolated (high frequencies), 0: interpolated
        return (1.0 / (self.factor * base)) * (1 - keep) + (1.0 / base) * keep

    @property
    def cos_sin_scale(self) -> float:
        return self._m(self.mscale) / self._m(self.mscale_all_dim)

    @property
    def attention_scale(self) -> float:
        return self._m(self.mscale_all_dim) ** 2


@functools.cache
def _inv_freq(rope: Rope, d: int) -> torch.Tensor:
    """Rope.inv_freq, once per drafter and width (every layer's q and k rotate each step)."""
    return rope.inv_freq(d)


def rotate(x: torch.Tensor, pos: torch.Tensor, rope: Rope, interleaved: bool) -> torch.Tensor:
    """RoPE over x's last dim (even) at positions pos (x's leading shape, less any head dim
    between): GPT-J pairs (2i, 2i + 1) when interleaved, else NeoX halves (i, i + d/2)."""
    d = x.shape[-1]
    ang = pos.to(torch.float32)[..., None] * _inv_freq(rope, d).to(x.device)  # [..., d/2]
    while ang.dim() < x.dim():  # broadcast over the head dim
        ang = ang.unsqueeze(-2)
    cos, sin = ang.cos() * rope.cos_sin_scale, ang.sin() * rope.cos_sin_scale
    xf = x.float()
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)
    else:
        a, b = xf[..., : d // 2], xf[..., d // 2:]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
    return out.to(x.dtype)


@dataclass(frozen=True)
class NetConfig:
    """A drafter's config.json, read for its format (`read_config`)."""

    fmt: DrafterFormat
    hidden_size: int
    target_hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    eps: float
    rope: Rope
    block_size: int
    mask_token_id: int
    taps: tuple[int, ...]
    vocab_size: int
    markov_rank: int = 0
    confidence: bool = False
    logit_scale: float = 1.0
    num_kv_heads: int = 0  # GQA
    head_dim: int = 0
    q_lora_rank: int = 0  # MLA
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def cache_width(self) -> tuple[int, ...]:
        """One position's cache entry per layer: [2, kv heads, head dim] (k, v) for GQA,
        [latent + rope] for MLA."""
        if self.fmt.attention == "gqa":
            return (2, self.num_kv_heads, self.head_dim)
        return (self.kv_lora_rank + self.qk_rope_head_dim,)


def torch_linear(x: torch.Tensor, weight: torch.Tensor,
                 scale: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight)


class Proj(nn.Module):
    """A bias-free projection whose product is `op`: torch's until the drafter is given the
    engine's `linear` kernel (decode-sized rows stream the weight; torch's sgemm repacked the
    whole weight every call: a step's Markov head and 35 projections took 15 ms of 42)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in))
        self.op: Callable[..., torch.Tensor] = torch_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.weight, None)


class Mlp(nn.Module):
    def __init__(self, H: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = Proj(H, inter)
        self.up_proj = Proj(H, inter)
        self.down_proj = Proj(inter, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul_ref(torch.cat([self.gate_proj(x), self.up_proj(x)], -1)))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
           scale: float) -> torch.Tensor:
    """q [B, N, h, d], k [B, S, h, d], v [B, S, h, dv], mask [B, S] (True: a key to read;
    every query reads the same keys) -> [B, N, h * dv] in fp32 softmax."""
    s = torch.einsum("bnhd,bshd->bhns", q.float(), k.float()) * scale
    s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    o = torch.einsum("bhns,bshd->bnhd", s.softmax(-1), v.float())
    return o.flatten(2).to(q.dtype)


class GqaAttention(nn.Module):
    def __init__(self, c: NetConfig) -> None:
        super().__init__()
        H, h, kvh, d = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        self.c = c
        self.q_proj = Proj(H, h * d)
        self.k_proj = Proj(H, kvh * d)
        self.v_proj = Proj(H, kvh * d)
        self.o_proj = Proj(h * d, H)
        self.q_norm = RMSNorm(d, c.eps)
        self.k_norm = RMSNorm(d, c.eps)

    def entries(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Cache entries [..., 2, kv heads, d] of rows x [..., H] at positions pos [...]."""
        c = self.c
        k = self.k_norm(self.k_proj(x).unflatten(-1, (c.num_kv_heads, c.head_dim)))
        k = rotate(k, pos, c.rope, interleaved=False)
        v = self.v_proj(x).unflatten(-1, (c.num_kv_heads, c.head_dim))
        return torch.stack([k, v], -3)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, ctx: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """x [B, N, H] the block, pos [B, N]; ctx [B, S, 2, kvh, d] with mask [B, S]."""
        c = self.c
        q = self.q_norm(self.q_proj(x).unflatten(-1, (c.num_heads, c.head_dim)))
        q = rotate(q, pos, c.rope, interleaved=False)
        kv = torch.cat([ctx, self.entries(x, pos)], 1)
        group = c.num_heads // c.num_kv_heads
        k = kv[:, :, 0].repeat_interleave(group, 2)
        v = kv[:, :, 1].repeat_interleave(group, 2)
        full = torch.cat([mask, mask.new_ones(x.shape[:2])], 1)
        return self.o_proj(attend(q, k, v, full, c.head_dim ** -0.5))


class MlaAttention(nn.Module):
    def __init__(self, c: NetConfig) -> None:
        super().__init__()
        H, h = c.hidden_size, c.num_heads
        self.c = c
        self.q_a_proj = Proj(H, c.q_lora_rank)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.eps)
        self.q_b_proj = Proj(c.q_lora_rank, h * (c.qk_nope_head_dim + c.qk_rope_head_dim))
        self.kv_a_proj_with_mqa = Proj(H, c.kv_lora_rank + c.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.eps)
        self.kv_b_proj = Proj(c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim))
        self.o_proj = Proj(h * c.v_head_dim, H)

    def entries(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Cache entries [..., latent + rope]: the normed latent and the roped k_pe."""
        latent, k_pe = self.kv_a_proj_with_mqa(x).split(
            [self.c.kv_lora_rank, self.c.qk_rope_head_dim], -1)
        return torch.cat([self.kv_a_layernorm(latent),
                          rotate(k_pe, pos, self.c.rope, interleaved=True)], -1)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, ctx: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        c, h = self.c, self.c.num_heads
        nope, rope = c.qk_nope_head_dim, c.qk_rope_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).unflatten(-1, (h, nope + rope))
        q = torch.cat([q[..., :nope], rotate(q[..., nope:], pos, c.rope, True)], -1)
        e = torch.cat([ctx, self.entries(x, pos)], 1)  # [B, S + N, latent + rope]
        latent, k_pe = e.split([c.kv_lora_rank, rope], -1)
        kv = self.kv_b_proj(latent).unflatten(-1, (h, nope + c.v_head_dim))
        k = torch.cat([kv[..., :nope], k_pe[:, :, None].expand(-1, -1, h, -1)], -1)
        full = torch.cat([mask, mask.new_ones(x.shape[:2])], 1)
        scale = (nope + rope) ** -0.5 * c.rope.attention_scale
        return self.o_proj(attend(q, k, kv[..., nope:], full, scale))


class DraftLayer(nn.Module):
    def __init__(self, c: NetConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.eps)
        self.self_attn: GqaAttention | MlaAttention = \
            GqaAttention(c) if c.fmt.attention == "gqa" else MlaAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.eps)
        self.mlp = Mlp(c.hidden_size, c.intermediate_size)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, ctx: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), pos, ctx, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class ContextDraftNet(nn.Module):
    """The drafter's own parameters; the target's embedding and lm_head are passed in."""

    def __init__(self, c: NetConfig) -> None:
        super().__init__()
        self.c = c
        setattr(self, c.fmt.fc, Proj(len(c.taps) * c.target_hidden_size, c.hidden_size))
        setattr(self, c.fmt.fc_norm, RMSNorm(c.hidden_size, c.eps))
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_layers))
        setattr(self, c.fmt.final_norm, RMSNorm(c.hidden_size, c.eps))
        if c.fmt.dspark:
            self.markov_head = nn.Module()
            self.markov_head.markov_w1 = nn.Embedding(c.vocab_size, c.markov_rank)
            self.markov_head.markov_w2 = Proj(c.markov_rank, c.vocab_size)
            if c.confidence:
                self.confidence_head = nn.Module()
                self.confidence_head.proj = nn.Linear(c.hidden_size + c.markov_rank, 1)

    def context(self, taps: torch.Tensor, pos: torch.Tensor) -> list[torch.Tensor]:
        """taps [T, n * D] of T committed positions pos [T] -> each layer's cache entries."""
        fc, norm = getattr(self, self.c.fmt.fc), getattr(self, self.c.fmt.fc_norm)
        ctx = norm(fc(taps.to(fc.weight.dtype)))
        return [layer.self_attn.entries(ctx, pos) for layer in self.layers]

    def block(self, x: torch.Tensor, pos: torch.Tensor, ctx: list[torch.Tensor],
              mask: torch.Tensor) -> torch.Tensor:
        """x [B, N, H] the block's embeddings at pos [B, N]; ctx per layer [B, S, ...] with
        mask [B, S] -> final-normed rows [B, N, H]."""
        for layer, entries in zip(self.layers, ctx, strict=True):
            x = layer(x, pos, entries, mask)
        return getattr(self, self.c.fmt.final_norm)(x)

    def drafting_pass(self, anchors: torch.Tensor, starts: torch.Tensor, ctx: list[torch.Tensor],
                      mask: torch.Tensor, block_size: int, k: int,
                      embed: Callable[[torch.Tensor], torch.Tensor],
                      lm_head: Callable[[torch.Tensor], torch.Tensor],
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A draft step: each request's anchor [B] at position starts [B] and block_size - 1
        mask tokens, embedded by the target (`embed`), through the block over its context
        (`block`), then `draft`'s k drafts [B, k] and confidences."""
        ids = torch.full((anchors.shape[0], block_size), self.c.mask_token_id,
                         device=anchors.device)
        ids[:, 0] = anchors
        pos = starts[:, None] + torch.arange(block_size, device=anchors.device)
        dtype = next(self.parameters()).dtype
        h = self.block(embed(ids).to(dtype), pos, ctx, mask)
        return self.draft(h, anchors, k, lm_head)

    def draft(self, h: torch.Tensor, anchors: torch.Tensor, k: int,
              lm_head: Callable[[torch.Tensor], torch.Tensor],
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy drafts [B, k] from the block's rows h [B, N, H], and DSpark's confidences
        [B, k] (None without the head): each draft's chance given the ones before it."""
        rows, base = self.base_logits(h, k, lm_head)
        if not self.c.fmt.dspark:
            return base.argmax(-1), None
        prev, drafts = anchors, []
        for i in range(k):  # sequential: each row's Markov term reads the draft before it
            prev = self.markov_logits(base[:, i:i + 1], prev[:, None])[:, 0].argmax(-1)
            drafts.append(prev)
        out = torch.stack(drafts, 1)
        if not self.c.confidence:
            return out, None
        before = torch.cat([anchors[:, None], out[:, :-1]], 1)
        return out, torch.sigmoid(self.confidence_logits(rows, before))

    def base_logits(self, h: torch.Tensor, k: int,
                    lm_head: Callable[[torch.Tensor], torch.Tensor],
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The k drafting rows of h [B, N, H] and their fp32 lm_head logits [B, k, V]."""
        first = self.c.fmt.first_draft_row
        rows = h[:, first:first + k]
        base = lm_head(rows.flatten(0, 1)).view(*rows.shape[:2], -1).float()
        return rows, base * self.c.logit_scale

    def markov_logits(self, base: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """DSpark's logits [B, k, V]: base plus the Markov term of each row's previous
        token prev [B, k] (the anchor, then the draft before; the labels when training)."""
        head = self.markov_head
        return base + head.markov_w2(head.markov_w1(prev)).float() * self.c.logit_scale

    def confidence_logits(self, rows: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The confidence head's logits [B, k] (sigmoid: each draft's survival given the
        ones before it) from the drafting rows and their previous tokens."""
        feats = torch.cat([rows, self.markov_head.markov_w1(prev).to(rows.dtype)], -1)
        proj = self.confidence_head.proj
        return F.linear(feats.float(), proj.weight.float(), proj.bias.float()).squeeze(-1)


def random_weights(net: ContextDraftNet, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random parameters (norm weights near 1), for tests and benchmarks."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in net.state_dict().items():
        if name.endswith("norm.weight"):
            out[name] = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        else:
            fan_in = 1 if "markov_w1" in name or p.dim() == 1 else p.shape[-1]
            out[name] = torch.randn(p.shape, generator=g) / math.sqrt(fan_in)
    return out


def config_dict(c: NetConfig) -> dict[str, Any]:
    """config.json as the format's own loader reads it (`read_config` reads it back)."""
    d: dict[str, Any] = {
        "architectures": [c.fmt.architecture], "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "intermediate_size": c.intermediate_size, "hidden_act": "silu",
        "rms_norm_eps": c.eps, "vocab_size": c.vocab_size, "block_size": c.block_size,
        "num_target_layers": len(c.taps), "target_hidden_size": c.target_hidden_size}
    if c.fmt.attention == "mla":
        d.update(model_type="k3_dspark", q_lora_rank=c.q_lora_rank,
                 kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
                 qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
                 rope_theta=c.rope.theta, target_layer_ids=list(c.taps),
                 mask_token_id=c.mask_token_id, logit_scale=c.logit_scale)
    else:
        d.update(model_type="qwen3", num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
                 rope_parameters={"rope_type": "default", "rope_theta": c.rope.theta},
                 layer_types=["full_attention"] * c.num_layers,
                 dflash_config={"mask_token_id": c.mask_token_id,
                                "target_layer_ids": list(c.taps)})
    if c.fmt.dspark:
        d.update(markov_rank=c.markov_rank, markov_head_type="vanilla",
                 enable_confidence_head=c.confidence, confidence_head_with_markov=c.confidence)
    return d
