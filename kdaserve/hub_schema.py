"""What config.json may say, read field by field for `ModelConfig.from_hf`: the layer kinds in
either schema (Moonshot's hub lists, 1-indexed; transformers' `layer_types`), the MLP kinds, the
required fields, and the fields of later Kimi models that would change the math and so are
refused rather than ignored.
"""

from __future__ import annotations

from typing import Any

KDA = "kda"
MLA = "mla"
DENSE = "dense"
MOE = "moe"

# Fields of later Kimi models (K2.5/K3 family) that change the math. Loading such a checkpoint with
# this engine would silently compute a different function, so a non-default value is an error.
# Value: the default under which the field is harmless.
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "mla_use_output_gate": False,
    "attn_res_block_size": None,
    "gate_lower_bound": None,
    "use_full_rank_gate": False,
    "moe_latent_size": None,
    "moe_latent_dim": None,
    "use_latent_moe": False,
    "latent_moe": False,
    "num_nextn_predict_layers": 0,
    "attention_bias": False,
    "num_v_heads": None,
}


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
    if act != "silu":
        raise ValueError(f"config.json: hidden_act={act!r} is not supported (only 'silu')")
    if raw.get("mla_use_nope", True) is False:
        raise ValueError("config.json: mla_use_nope=false (rotary MLA) is not supported")
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
