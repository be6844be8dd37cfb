"""Model configuration: one `ModelConfig` translated once from a checkpoint's config.json.

Two schemas exist in the wild: Moonshot's hub schema (`linear_attn_config` with 1-indexed layer
lists, `first_k_dense_replace`, `moe_layer_freq`) and transformers' (`layer_types`,
`mlp_layer_types`, `linear_*`). Both map to the same frozen dataclass; nothing downstream reads
raw HF names.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kdaserve.hub_schema import (
    DENSE,
    KDA,
    MLA,
    MOE,
    MXFP4_GROUP,
    expert_format_of,
    k3_fields,
    layer_types_of,
    mlp_types_of,
    reject_unsupported,
    require,
    text_config_of,
)
from kdaserve.vision_config import VisionConfig

__all__ = ["DENSE", "KDA", "MLA", "MOE", "ModelConfig"]

@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # KDA or MLA per layer, 0-indexed
    mlp_types: tuple[str, ...]  # DENSE or MOE per layer
    intermediate_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    # KDA
    kda_num_heads: int
    kda_head_dim: int
    kda_conv_size: int
    # MLA
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # MoE
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    router_activation: str  # "sigmoid" or "softmax"
    moe_renormalize: bool
    routed_scaling_factor: float
    num_expert_group: int
    topk_group: int
    # tokens
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    checkpoint_dtype: str = "bfloat16"
    # Kimi K3 (k3_spec.md); the defaults are Kimi Linear
    hidden_act: str = "silu"  # "situ": SiTU-GLU (soft-capped gate and linear branches)
    situ_beta: float = 1.0
    situ_linear_beta: float | None = None
    attn_res_block_size: int | None = None  # Attention Residuals: layers per bank block
    routed_expert_hidden_size: int | None = None  # LatentMoE: experts run at this width
    latent_moe_use_norm: bool = False  # RMSNorm on the latent expert sum
    mla_use_output_gate: bool = False  # sigmoid(g_proj(x)) on MLA's output
    kda_gate_lower_bound: float | None = None  # KDA decay lb * sigmoid(...) instead of softplus
    kda_full_rank_gate: bool = False  # KDA output gate g_proj [P, D] instead of g_a/g_b
    # "language_model." for K3's KimiK3ForConditionalGeneration checkpoints
    tensor_prefix: str = ""
    vision: VisionConfig | None = None  # the checkpoint also holds a vision tower (K3)
    # "mxfp4": the routed experts stored (and held) as compressed-tensors' packed MXFP4
    # (kernels/ref/mxfp4.py); None: stored as floats
    expert_format: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"config has {len(self.layer_types)} layer types for "
                f"num_hidden_layers={self.num_hidden_layers}"
            )
        if len(self.mlp_types) != self.num_hidden_layers:
            raise ValueError(
                f"config has {len(self.mlp_types)} mlp types for "
                f"num_hidden_layers={self.num_hidden_layers}"
            )
        for i, t in enumerate(self.layer_types):
            if t not in (KDA, MLA):
                raise ValueError(f"layer {i}: unknown attention type {t!r}")
        if MOE in self.mlp_types:
            if self.num_experts_per_token > self.num_experts:
                raise ValueError(
                    f"num_experts_per_token={self.num_experts_per_token} > "
                    f"num_experts={self.num_experts}"
                )
            if self.num_experts % self.num_expert_group:
                raise ValueError(
                    f"num_experts={self.num_experts} not divisible by "
                    f"num_expert_group={self.num_expert_group}"
                )
            if self.topk_group > self.num_expert_group:
                raise ValueError(
                    f"topk_group={self.topk_group} > num_expert_group={self.num_expert_group}"
                )
        if self.router_activation not in ("sigmoid", "softmax"):
            raise ValueError(
                f"moe_router_activation_func={self.router_activation!r} is not supported "
                "(sigmoid or softmax)"
            )
        if self.expert_format not in (None, "mxfp4"):
            raise ValueError(f"expert_format={self.expert_format!r} is not supported (mxfp4)")
        if self.expert_format == "mxfp4":
            width = self.routed_expert_hidden_size or self.hidden_size
            for name, n in (("the experts' input width", width),
                            ("moe_intermediate_size", self.moe_intermediate_size)):
                if n % MXFP4_GROUP:
                    raise ValueError(f"MXFP4 experts: {name} = {n} is not a multiple of "
                                     f"{MXFP4_GROUP}")

    # ---- derived sizes (properties, never stored) ----
    @property
    def has_vision_tower(self) -> bool:
        return self.vision is not None

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == KDA]

    @property
    def mla_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == MLA]

    @property
    def kda_dim(self) -> int:
        """P = H * K: width of the q/k/v projections of a KDA layer."""
        return self.kda_num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kernel_features(self) -> frozenset[str]:
        """What this model needs of the kernels beyond Kimi Linear's ops (kernels.FEATURE_OPS)."""
        needs = set()
        if self.kda_gate_lower_bound is not None and KDA in self.layer_types:
            needs.add("kda_lower_bound")
        if self.hidden_act == "situ" and MOE in self.mlp_types:
            needs.add("situ")
        if self.expert_format == "mxfp4" and MOE in self.mlp_types:
            needs.add("mxfp4")
        return frozenset(needs)

    @property
    def has_k3_layers(self) -> bool:
        """Whether any of K3's layer changes is on (the native one-call decode has none)."""
        return bool(self.kernel_features) or self.hidden_act != "silu" or any((
            self.attn_res_block_size, self.routed_expert_hidden_size, self.mla_use_output_gate,
            self.kda_full_rank_gate))

    @property
    def latent_dim(self) -> int:
        """Values cached per token per MLA layer: normalised latent + shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    # ---- loading ----
    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        config_path = path / "config.json" if path.is_dir() else path
        if not config_path.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        with open(config_path) as f:
            raw = json.load(f)
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        text, vision = text_config_of(raw)
        wrapped = text is not raw
        expert_format = expert_format_of(text) or expert_format_of(raw)
        raw = text
        reject_unsupported(raw)
        n = require(raw, "num_hidden_layers")
        lac = raw.get("linear_attn_config") or {}
        k3 = k3_fields(raw, lac)
        layer_types = layer_types_of(raw, lac, n)
        mlp_types = mlp_types_of(raw, n)
        num_experts = raw.get("num_experts", raw.get("num_local_experts")) or 0
        grouped = raw.get("use_grouped_topk", True)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=require(raw, "vocab_size"),
            hidden_size=require(raw, "hidden_size"),
            num_hidden_layers=n,
            layer_types=layer_types,
            mlp_types=mlp_types,
            intermediate_size=raw.get("intermediate_size", 0),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            kda_num_heads=lac.get("num_heads", raw.get("linear_num_heads", 32)),
            kda_head_dim=lac.get("head_dim", raw.get("linear_head_dim", 128)),
            kda_conv_size=lac.get("short_conv_kernel_size", raw.get("linear_conv_kernel_dim", 4)),
            num_attention_heads=require(raw, "num_attention_heads"),
            q_lora_rank=raw.get("q_lora_rank"),
            kv_lora_rank=raw.get("kv_lora_rank", 512),
            qk_nope_head_dim=raw.get("qk_nope_head_dim", 128),
            qk_rope_head_dim=raw.get("qk_rope_head_dim", 64),
            v_head_dim=raw.get("v_head_dim", 128),
            num_experts=num_experts,
            num_experts_per_token=raw.get("num_experts_per_token",
                                          raw.get("num_experts_per_tok", 8)),
            num_shared_experts=raw.get("num_shared_experts", raw.get("n_shared_experts", 0)) or 0,
            moe_intermediate_size=raw.get("moe_intermediate_size", 0),
            router_activation=raw.get("moe_router_activation_func", "sigmoid"),
            moe_renormalize=raw.get("moe_renormalize", raw.get("norm_topk_prob", True)),
            routed_scaling_factor=raw.get("routed_scaling_factor", 1.0),
            num_expert_group=(raw.get("num_expert_group", raw.get("n_group", 1)) or 1)
            if grouped else 1,
            topk_group=(raw.get("topk_group", 1) or 1) if grouped else 1,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=raw.get("pad_token_id"),
            checkpoint_dtype=raw.get("torch_dtype", raw.get("dtype")) or "bfloat16",
            tensor_prefix="language_model." if wrapped else "",
            vision=None if vision is None else VisionConfig.from_dict(
                vision, require(raw, "hidden_size"), vision.get("media_placeholder_token_id")),
            expert_format=expert_format,
            **k3,
        )

    def summary(self) -> str:
        d = asdict(self)
        d.pop("extra")
        return ", ".join(f"{k}={v}" for k, v in d.items() if k not in ("layer_types", "mlp_types"))
