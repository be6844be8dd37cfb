"""K3's `vision_config` (k3_spec.md 3.3, 8): the MoonViT-3D tower, its 2x2 `sd2_tpool` merge and
the `patchmergerv2` projector into the text model's width. Defaults are the released values,
so a config that names only `model_type` reads as K3's tower.

The released config also names choices the code fixes (RMSNorm, a tanh-GELU MLP, bilinear
position interpolation, the merge and projector kinds, no biases): a value other than K3's
for any of them is refused by name, never read past."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# what the tower implements; a config may state these, only with these values
FIXED: dict[str, Any] = {
    "model_type": "moonvit3d", "pos_emb_type": "divided_fixed",
    "pos_emb_interpolation_mode": "bilinear", "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmergerv2", "projector_hidden_act": "gelu", "norm_type": "rmsnorm",
    "mlp_type": "mlp2", "activation_func": "gelu_pytorch_tanh", "attn_bias": False,
    "linear_bias": False, "patch_embed_proj_bias": False, "merge_kernel_size": [2, 2]}
# the tower's RMSNorm epsilon: mlx-vlm's constant, what SGLang's eps=None gives in bf16 (its
# fp32 would be finfo's 1.2e-7); the released checkpoint is bf16
VISION_NORM_EPS = 2.0 ** -7
MEDIA_PAD_ID = 163605  # K3's <|media_pad|> (config.json media_placeholder_token_id)


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int = 1024  # vt_hidden_size
    num_layers: int = 27
    num_heads: int = 12
    intermediate_size: int = 4096
    qkv_hidden_size: int = 1536  # attention width: heads x head_dim (128)
    patch_size: int = 14
    pos_emb_height: int = 64  # the learned position grid, interpolated to each image
    pos_emb_width: int = 64
    pos_emb_time: int = 4  # frames the sin/cos time embedding covers (images: 1, none added)
    mm_hidden_size: int = 1024
    text_hidden_size: int = 7168
    projector_ln_eps: float = 1e-5
    media_pad_id: int = MEDIA_PAD_ID

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.num_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any], text_hidden_size: int,
                  media_pad_id: int | None = None) -> VisionConfig:
        for key, want in FIXED.items():
            if key in raw and raw[key] != want:
                raise ValueError(f"vision_config.{key}={raw[key]!r} is not implemented "
                                 f"(K3's tower: {want!r})")
        given = raw.get("text_hidden_size", text_hidden_size)
        if given != text_hidden_size:
            raise ValueError(f"vision_config.text_hidden_size {given} is not the text model's "
                             f"hidden size {text_hidden_size}")
        d = cls()
        c = cls(hidden_size=raw.get("vt_hidden_size", d.hidden_size),
                num_layers=raw.get("vt_num_hidden_layers", d.num_layers),
                num_heads=raw.get("vt_num_attention_heads", d.num_heads),
                intermediate_size=raw.get("vt_intermediate_size", d.intermediate_size),
                qkv_hidden_size=raw.get("qkv_hidden_size", d.qkv_hidden_size),
                patch_size=raw.get("patch_size", d.patch_size),
                pos_emb_height=raw.get("init_pos_emb_height", d.pos_emb_height),
                pos_emb_width=raw.get("init_pos_emb_width", d.pos_emb_width),
                pos_emb_time=raw.get("init_pos_emb_time", d.pos_emb_time),
                mm_hidden_size=raw.get("mm_hidden_size", d.mm_hidden_size),
                text_hidden_size=text_hidden_size,
                projector_ln_eps=raw.get("projector_ln_eps", d.projector_ln_eps),
                media_pad_id=MEDIA_PAD_ID if media_pad_id is None else media_pad_id)
        if c.mm_hidden_size != c.hidden_size:
            raise ValueError(f"vision_config.mm_hidden_size {c.mm_hidden_size} must equal "
                             f"vt_hidden_size {c.hidden_size} (the merge feeds the tower's rows)")
        if c.qkv_hidden_size % c.num_heads or c.head_dim % 4:
            raise ValueError(f"vision_config: qkv_hidden_size {c.qkv_hidden_size} over "
                             f"{c.num_heads} heads needs a head size divisible by 4 (2-D RoPE)")
        return c

    def to_dict(self) -> dict[str, Any]:
        """The released schema (what `from_dict` reads back)."""
        return {**FIXED, "vt_hidden_size": self.hidden_size,
                "vt_num_hidden_layers": self.num_layers, "vt_num_attention_heads": self.num_heads,
                "vt_intermediate_size": self.intermediate_size,
                "qkv_hidden_size": self.qkv_hidden_size, "patch_size": self.patch_size,
                "init_pos_emb_height": self.pos_emb_height,
                "init_pos_emb_width": self.pos_emb_width, "init_pos_emb_time": self.pos_emb_time,
                "mm_hidden_size": self.mm_hidden_size, "text_hidden_size": self.text_hidden_size,
                "projector_ln_eps": self.projector_ln_eps}
