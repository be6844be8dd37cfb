"""What config.json may say, read field by field for `ModelConfig.from_dict`: the layer kinds
in either schema (Moonshot's hub lists, 1-indexed; transformers' `layer_types`), the MLP kinds,
the required fields, K3's wrapper and fields, and the fields of other Kimi models that would
change the math and so are refused rather than ignored; and the writer of that schema.
"""

from __future__ import annotations

from typing import Any

KDA = "kda"
MLA = "mla"
DENSE = "dense"
MOE = "moe"

# Fields of other Kimi-family models that change the math and that we do not implement. Loading
# such a checkpoint would silently compute a different function, so a non-default value is an
# error. Value: the default under which the field is harmless. (K3's own fields, AttnRes,
# SiTU, LatentMoE, the lower-bound gate, are read by `k3_fields`.)
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "moe_latent_size": None,
    "moe_latent_dim": None,
    "use_latent_moe": False,
    "latent_moe": False,
    "num_nextn_predict_layers": 0,
    "attention_bias": False,
    "num_v_heads": None,
}


# compressed-tensors' MXFP4 as K3 ships it (k3_spec.md 5.2): what `expert_format_of` accepts
# field by field, and what `hub_dict` writes for a checkpoint with MXFP4 experts
MXFP4_GROUP = 32  # input elements per E8M0 scale (kernels/ref/mxfp4.py)
MXFP4_WEIGHTS: dict[str, Any] = {
    "num_bits": 4, "type": "float", "strategy": "group", "group_size": MXFP4_GROUP,
    "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8", "zp_dtype": None,
    "actorder": None, "block_structure": None, "observer": "minmax"}
MXFP4_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed", "kv_cache_scheme": None,
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": MXFP4_WEIGHTS,
                                  "input_activations": None, "output_activations": None}},
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*",
               "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
               "re:.*vision_tower.*", "re:.*mm_projector.*"]}
_MXFP4_OPTIONAL = {"observer", "observer_kwargs", "actorder", "block_structure", "zp_dtype"}


def expert_format_of(raw: dict[str, Any]) -> str | None:
    """"mxfp4" for a `quantization_config` that is compressed-tensors' MXFP4 (only the routed
    experts are packed; which tensors are is read per tensor, from `weight_packed`), None
    without one; any other quantization is refused, naming the field and its value."""
    q = raw.get("quantization_config")
    if q is None:
        return None

    def refuse(field: str, value: Any) -> ValueError:
        return ValueError(f"config.json: quantization_config.{field}={value!r} is not "
                          "supported (compressed-tensors mxfp4-pack-quantized only)")

    for key in ("quant_method", "format"):
        if q.get(key) != MXFP4_CONFIG[key]:
            raise refuse(key, q.get(key))
    if q.get("quantization_status", "compressed") != "compressed":
        raise refuse("quantization_status", q.get("quantization_status"))
    if q.get("kv_cache_scheme") is not None:
        raise refuse("kv_cache_scheme", q["kv_cache_scheme"])
    groups = q.get("config_groups") or {}
    if not groups:
        raise refuse("config_groups", groups)
    for name, group in groups.items():
        for act in ("input_activations", "output_activations"):
            if group.get(act) is not None:
                raise refuse(f"config_groups.{name}.{act}", group[act])
        weights = group.get("weights") or {}
        for key, want in MXFP4_WEIGHTS.items():
            got = weights.get(key, want if key in _MXFP4_OPTIONAL else None)
            if key == "scale_dtype" and got in ("uint8", "torch.uint8"):
                continue
            if got != want and not (key in _MXFP4_OPTIONAL and key != "zp_dtype"):
                raise refuse(f"config_groups.{name}.weights.{key}", got)
    return "mxfp4"


def require(raw: dict[str, Any], key: str) -> Any:
    if key not in raw or raw[key] is None:
        raise ValueError(f"config.json: required field {key!r} is missing")
    return raw[key]


def reject_unsupported(raw: dict[str, Any]) -> None:
    sources = [raw, raw.get("linear_attn_config") or {}]
    for src in sources:
        for key, harmless in UNSUPPORTED_FIELDS.items():
            if key in src and src[key] != harmless and src[key] is not None:
                raise ValueError(
                    f"config.json: field {key!r}={src[key]!r} belongs to a newer Kimi model that "
                    "kdaserve does not implement"
                )
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "situ"):
        raise ValueError(f"config.json: hidden_act={act!r} is not supported (silu or situ)")
    topk = raw.get("topk_method", "noaux_tc")
    if topk not in ("noaux_tc", None):
        raise ValueError(f"config.json: topk_method={topk!r} is not supported (noaux_tc)")
    if raw.get("mla_use_nope", True) is not True:
        raise ValueError("config.json: mla_use_nope=False (rotary MLA) is not supported")
    kv_heads = raw.get("num_key_value_heads")
    heads = raw.get("num_attention_heads")
    if kv_heads is not None and heads is not None and kv_heads != heads:
        raise ValueError(
            f"config.json: num_key_value_heads={kv_heads} != num_attention_heads; MLA has no GQA"
        )


def layer_types_of(raw: dict[str, Any], lac: dict[str, Any], n: int) -> tuple[str, ...]:
    if raw.get("layer_types") is not None:  # transformers' schema wins, as in transformers
        names = {"linear_attention": KDA, "full_attention": MLA, KDA: KDA, MLA: MLA}
        try:
            return tuple(names[t] for t in raw["layer_types"])
        except KeyError as e:
            raise ValueError(f"config.json: unknown layer type {e.args[0]!r} in layer_types") from e
    if "kda_layers" in lac and "full_attn_layers" in lac:
        types: list[str | None] = [None] * n
        # The hub lists are 1-indexed: layer i is KDA iff (i + 1) in kda_layers.
        for key, kind in (("kda_layers", KDA), ("full_attn_layers", MLA)):
            for one_based in lac[key]:
                if not 1 <= one_based <= n:
                    raise ValueError(f"config.json: linear_attn_config.{key} has {one_based}, "
                                     f"outside 1..{n} (the lists are 1-indexed)")
                if types[one_based - 1] not in (None, kind):
                    raise ValueError(f"config.json: layer {one_based - 1} (0-indexed) is in both "
                                     "kda_layers and full_attn_layers")
                types[one_based - 1] = kind
        missing = [i for i, t in enumerate(types) if t is None]
        if missing:
            raise ValueError(f"config.json: layers {missing} (0-indexed) are in neither "
                             "kda_layers nor full_attn_layers")
        return tuple(t for t in types if t is not None)
    raise ValueError("config.json: neither layer_types nor linear_attn_config.kda_layers/"
                     "full_attn_layers is given")


def mlp_types_of(raw: dict[str, Any], n: int) -> tuple[str, ...]:
    if raw.get("mlp_layer_types") is not None:
        names = {"dense": DENSE, "sparse": MOE, MOE: MOE}
        try:
            return tuple(names[t] for t in raw["mlp_layer_types"])
        except KeyError as e:
            raise ValueError(f"config.json: unknown mlp type {e.args[0]!r}") from e
    has_experts = bool(raw.get("num_experts", raw.get("num_local_experts")))
    first_dense = raw.get("first_k_dense_replace", 1)
    freq = raw.get("moe_layer_freq", 1) or 1
    return tuple(
        MOE if has_experts and i >= first_dense and i % freq == 0 else DENSE for i in range(n)
    )


def text_config_of(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A `kimi_k3` config nests the text model in `text_config` (token ids at the top, and the
    vision tower beside it): (the text model's fields, the vision_config or None)."""
    text = raw.get("text_config")
    if text is None:
        if raw.get("model_type") == "kimi_k3":
            raise ValueError("config.json: model_type 'kimi_k3' without a text_config")
        return raw, None
    if not isinstance(text, dict):
        raise ValueError("config.json: text_config is not an object")
    merged = dict(text)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
        if key in raw and key not in merged:
            merged[key] = raw[key]
    vision = raw.get("vision_config")
    if vision is not None and not isinstance(vision, dict):
        raise ValueError("config.json: vision_config is not an object")
    if vision is not None and "media_placeholder_token_id" in raw:
        vision = {**vision, "media_placeholder_token_id": raw["media_placeholder_token_id"]}
    return merged, vision


def k3_fields(raw: dict[str, Any], lac: dict[str, Any]) -> dict[str, Any]:
    """Kimi K3's text-model fields (k3_spec.md section 3.2), each a ModelConfig field; absent
    ones take the value under which the model is Kimi Linear."""
    act = raw.get("hidden_act", "silu")
    beta, linear_beta = raw.get("activation_situ_beta"), raw.get("activation_situ_linear_beta")
    if act == "silu" and (beta is not None or linear_beta is not None):
        raise ValueError("config.json: activation_situ_* given with hidden_act='silu'")
    block = raw.get("attn_res_block_size")
    if block is not None and (not isinstance(block, int) or block < 1):
        raise ValueError(f"config.json: attn_res_block_size={block!r} is not a positive int")
    latent = raw.get("routed_expert_hidden_size")
    if latent is not None and (not isinstance(latent, int) or latent < 1):
        raise ValueError(f"config.json: routed_expert_hidden_size={latent!r} is not a "
                         "positive int")
    if raw.get("latent_moe_use_norm") and latent is None:
        raise ValueError("config.json: latent_moe_use_norm without routed_expert_hidden_size")
    bound = lac.get("gate_lower_bound", raw.get("gate_lower_bound"))
    if bound is not None and not (isinstance(bound, (int, float)) and bound < 0):
        raise ValueError(f"config.json: gate_lower_bound={bound!r} is not a negative number")
    return {
        "hidden_act": act,
        "situ_beta": float(beta) if beta is not None else 1.0,
        "situ_linear_beta": float(linear_beta) if linear_beta is not None else None,
        "attn_res_block_size": block,
        "routed_expert_hidden_size": latent,
        "latent_moe_use_norm": bool(raw.get("latent_moe_use_norm", False)),
        "mla_use_output_gate": bool(raw.get("mla_use_output_gate", False)),
        "kda_gate_lower_bound": float(bound) if bound is not None else None,
        "kda_full_rank_gate": bool(lac.get("use_full_rank_gate",
                                           raw.get("use_full_rank_gate", False))),
    }
