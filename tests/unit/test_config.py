"""ModelConfig: Moonshot's hub schema and transformers' schema map to the same config, and
configs of models kdaserve does not implement are rejected by name (no weights involved)."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kdaserve.checkpoint import PRESETS, preset_config
from kdaserve.config import DENSE, KDA, MLA, MOE, ModelConfig
from kdaserve.hub_writer import hub_dict

# 1-indexed, exactly as in Kimi-Linear-48B-A3B-Instruct's config.json (kda_spec.md §4)
KDA_LAYERS_1 = [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26]
FULL_ATTN_LAYERS_1 = [4, 8, 12, 16, 20, 24, 27]
MLA_LAYERS_0 = [3, 7, 11, 15, 19, 23, 26]
# what `make-checkpoint` writes for each preset
PRESETS_HUB: dict[str, dict[str, Any]] = {
    name: hub_dict(preset_config(name)) for name in PRESETS
}


def kimi_linear_48b() -> dict[str, Any]:
    """config.json of moonshotai/Kimi-Linear-48B-A3B-Instruct (kda_spec.md §4)."""
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "auto_map": {
            "AutoConfig": "configuration_kimi.KimiLinearConfig",
            "AutoModel": "modeling_kimi.KimiLinearModel",
            "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM",
        },
        "vocab_size": 163840,
        "hidden_size": 2304,
        "num_hidden_layers": 27,
        "intermediate_size": 9216,
        "hidden_act": "silu",
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 72,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "linear_attn_config": {
            "kda_layers": list(KDA_LAYERS_1),
            "full_attn_layers": list(FULL_ATTN_LAYERS_1),
            "num_heads": 32,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
        },
        "num_experts": 256,
        "num_experts_per_token": 8,
        "num_shared_experts": 1,
        "moe_intermediate_size": 1024,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 2.446,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": 0,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "bos_token_id": 163584,
        "eos_token_id": 163586,
        "pad_token_id": 163839,
        "model_max_length": 1048576,
        "dtype": "bfloat16",
        "initializer_range": 0.02,
        "use_cache": True,
        "transformers_version": "4.57.1",
    }


def with_changes(raw: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """Deep copy of `raw` with `changes` applied; a key `linear_attn_config.x` edits the sub-dict
    and a value of `...` deletes the key."""
    out = copy.deepcopy(raw)
    for key, value in changes.items():
        target, leaf = out, key
        if key.startswith("linear_attn_config."):
            target, leaf = out["linear_attn_config"], key.split(".", 1)[1]
        if value is ...:
            del target[leaf]
        else:
            target[leaf] = value
    return out


def write_config(folder: Path, raw: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


# ---- Moonshot's hub schema ----

def test_kimi_linear_48b_layer_types_from_one_indexed_lists() -> None:
    c = ModelConfig.from_dict(kimi_linear_48b())
    assert c.num_hidden_layers == 27
    assert c.mla_layers == MLA_LAYERS_0
    assert c.kda_layers == [i - 1 for i in KDA_LAYERS_1]
    assert c.kda_layers[:4] == [0, 1, 2, 4]
    assert c.layer_types[24:] == (KDA, KDA, MLA)  # the last group is 2 KDA + 1 MLA
    assert c.mlp_types == (DENSE,) + (MOE,) * 26


def test_kimi_linear_48b_all_fields_mapped() -> None:
    c = ModelConfig.from_dict(kimi_linear_48b())
    expected = {
        "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "kda_num_heads": 32, "kda_head_dim": 128, "kda_conv_size": 4,
        "num_attention_heads": 32, "q_lora_rank": None, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1,
        "moe_intermediate_size": 1024, "router_activation": "sigmoid", "moe_renormalize": True,
        "routed_scaling_factor": 2.446, "num_expert_group": 1, "topk_group": 1,
        "bos_token_id": 163584, "eos_token_ids": (163586,), "pad_token_id": 163839,
        "checkpoint_dtype": "bfloat16",
    }
    assert {k: getattr(c, k) for k in expected} == expected
    # derived sizes (spec §1, §2): P = 32 * 128, dq = 192, 576 cached values per MLA token
    assert (c.kda_dim, c.qk_head_dim, c.latent_dim) == (4096, 192, 576)


def test_from_pretrained_reads_folder_and_file(tmp_path: Path) -> None:
    folder = write_config(tmp_path / "ckpt", kimi_linear_48b())
    from_folder = ModelConfig.from_pretrained(folder)
    assert from_folder == ModelConfig.from_dict(kimi_linear_48b())
    assert ModelConfig.from_pretrained(folder / "config.json") == from_folder
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path / "empty")


@pytest.mark.parametrize(
    "changes,expected_moe",
    [
        ({"moe_layer_freq": 2}, [2, 4, 6]),  # i % 2 == 0 and i >= 1
        ({"first_k_dense_replace": 2}, [2, 3, 4, 5, 6, 7]),
        ({"first_k_dense_replace": 2, "moe_layer_freq": 2}, [2, 4, 6]),
        ({"first_k_dense_replace": 3, "moe_layer_freq": 2}, [4, 6]),
        ({"first_k_dense_replace": 0}, [0, 1, 2, 3, 4, 5, 6, 7]),
        ({"num_experts": 0}, []),
    ],
    ids=["freq2", "first_dense2", "first_dense2-freq2", "first_dense3-freq2", "no_dense",
         "no_experts"],
)
def test_dense_and_moe_layers(changes: dict[str, Any], expected_moe: list[int]) -> None:
    raw = with_changes(PRESETS_HUB["small"], changes)
    c = ModelConfig.from_dict(raw)
    assert [i for i, t in enumerate(c.mlp_types) if t == MOE] == expected_moe
    assert all(t == DENSE for i, t in enumerate(c.mlp_types) if i not in expected_moe)


def test_non_contiguous_moe_has_no_hub_form() -> None:
    c = ModelConfig.from_dict(with_changes(PRESETS_HUB["small"], {"moe_layer_freq": 2}))
    with pytest.raises(ValueError, match="first_k_dense_replace"):
        hub_dict(c)


def test_ungrouped_router_ignores_group_fields() -> None:
    raw = with_changes(PRESETS_HUB["small"], {"use_grouped_topk": False})
    assert PRESETS_HUB["small"]["num_expert_group"] == 4
    c = ModelConfig.from_dict(raw)
    assert (c.num_expert_group, c.topk_group) == (1, 1)


def test_eos_list_and_missing_eos() -> None:
    c = ModelConfig.from_dict(with_changes(kimi_linear_48b(), {"eos_token_id": [163586, 163585]}))
    assert c.eos_token_ids == (163586, 163585)
    assert ModelConfig.from_dict(with_changes(kimi_linear_48b(), {"eos_token_id": None})
                                 ).eos_token_ids == ()


# ---- transformers' schema ----

def transformers_config(**overrides: Any) -> Any:
    transformers = pytest.importorskip("transformers")
    kw: dict[str, Any] = {
        "vocab_size": 4096, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_hidden_layers": 6, "num_attention_heads": 2,
        "num_key_value_heads": 2, "kv_lora_rank": 32, "q_lora_rank": None,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "num_local_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 2,
        "topk_group": 1, "routed_scaling_factor": 1.5, "norm_topk_prob": False,
        "linear_num_heads": 2, "linear_head_dim": 32, "linear_conv_kernel_dim": 3,
        "bos_token_id": 1, "eos_token_id": [2, 3],
        "pad_token_id": 0,
        "layer_types": ["linear_attention", "full_attention", "linear_attention",
                     "linear_attention", "linear_attention", "full_attention"],
        "mlp_layer_types": ["dense", "dense", "sparse", "sparse", "dense", "sparse"],
    }
    kw.update(overrides)
    return transformers.KimiLinearConfig(**kw)


def test_transformers_save_pretrained_loads(tmp_path: Path) -> None:
    transformers_config().save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert "linear_attn_config" not in raw and "layer_types" in raw  # really the other schema
    c = ModelConfig.from_pretrained(tmp_path)
    assert c.layer_types == (KDA, MLA, KDA, KDA, KDA, MLA)
    assert c.mlp_types == (DENSE, DENSE, MOE, MOE, DENSE, MOE)
    expected = {
        "vocab_size": 4096, "hidden_size": 64, "intermediate_size": 128,
        "kda_num_heads": 2, "kda_head_dim": 32, "kda_conv_size": 3,
        "num_attention_heads": 2, "q_lora_rank": None, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1,
        "moe_intermediate_size": 32, "router_activation": "sigmoid", "moe_renormalize": False,
        "routed_scaling_factor": 1.5, "num_expert_group": 2, "topk_group": 1,
        "bos_token_id": 1, "eos_token_ids": (2, 3), "pad_token_id": 0,
    }
    assert {k: getattr(c, k) for k in expected} == expected


def test_transformers_default_config_is_kimi_linear_48b(tmp_path: Path) -> None:
    """transformers' defaults describe Kimi-Linear-48B; both schemas must give one config."""
    transformers = pytest.importorskip("transformers")
    # its default layer_types follow a different (4-periodic) pattern: pass the hub lists,
    # which transformers reads 1-indexed as well
    transformers.KimiLinearConfig(
        linear_attn_config=kimi_linear_48b()["linear_attn_config"], dtype="bfloat16",
    ).save_pretrained(tmp_path)
    ours = ModelConfig.from_pretrained(tmp_path)
    assert ours.mla_layers == MLA_LAYERS_0
    assert ours == ModelConfig.from_dict(kimi_linear_48b())


def test_layer_types_win_over_linear_attn_config() -> None:
    """transformers reads `linear_attn_config` only when `layer_types` is absent."""
    raw = json.loads(json.dumps(transformers_config().to_dict()))
    raw["linear_attn_config"] = {"kda_layers": [1, 2, 3, 4, 5], "full_attn_layers": [6],
                                 "num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 3}
    c = ModelConfig.from_dict(raw)
    assert c.layer_types == (KDA, MLA, KDA, KDA, KDA, MLA)


def test_transformers_reads_hub_lists_like_we_do() -> None:
    """Independent check of the 1-indexing: transformers' own config on the 48B hub dict."""
    transformers = pytest.importorskip("transformers")
    raw = kimi_linear_48b()
    theirs = transformers.KimiLinearConfig(
        **{k: v for k, v in raw.items() if k not in ("auto_map", "rope_scaling")})
    ours = ModelConfig.from_dict(raw)
    mapped = {"linear_attention": KDA, "full_attention": MLA}
    assert tuple(mapped[t] for t in theirs.layer_types) == ours.layer_types
    assert tuple(DENSE if t == "dense" else MOE for t in theirs.mlp_layer_types) == ours.mlp_types


def test_unknown_transformers_layer_type() -> None:
    raw = transformers_config().to_dict()
    raw["layer_types"] = ["linear_attention"] * 5 + ["sliding_attention"]
    with pytest.raises(ValueError, match="sliding_attention"):
        ModelConfig.from_dict(raw)


# ---- later Kimi models: reject what would silently compute a different function ----

UNSUPPORTED: list[tuple[str, dict[str, Any], str]] = [
    ("hidden_act_gelu", {"hidden_act": "gelu"}, "hidden_act"),
    ("topk_method", {"topk_method": "greedy"}, "topk_method"),
    ("situ_beta_with_silu", {"activation_situ_beta": 4.0}, "activation_situ"),
    ("attn_res_block_zero", {"attn_res_block_size": 0}, "attn_res_block_size"),
    ("gate_lower_bound_positive", {"linear_attn_config.gate_lower_bound": 5.0},
     "gate_lower_bound"),
    ("latent_norm_without_latent", {"latent_moe_use_norm": True}, "latent_moe_use_norm"),
    ("latent_moe", {"moe_latent_size": 512}, "moe_latent_size"),
    ("mtp", {"num_nextn_predict_layers": 1}, "num_nextn_predict_layers"),
    ("rotary_mla", {"mla_use_nope": False}, "mla_use_nope"),
    ("gqa", {"num_key_value_heads": 8}, "num_key_value_heads"),
    ("attention_bias", {"attention_bias": True}, "attention_bias"),
]


@pytest.mark.parametrize("changes,field_name", [u[1:] for u in UNSUPPORTED],
                         ids=[u[0] for u in UNSUPPORTED])
def test_unsupported_field_raises_naming_it(changes: dict[str, Any], field_name: str) -> None:
    with pytest.raises(ValueError, match=field_name):
        ModelConfig.from_dict(with_changes(kimi_linear_48b(), changes))


HARMLESS: list[tuple[str, dict[str, Any]]] = [
    ("mla_output_gate_false", {"mla_use_output_gate": False}),
    ("gate_lower_bound_null", {"gate_lower_bound": None}),
    ("gate_lower_bound_null_lac", {"linear_attn_config.gate_lower_bound": None}),
    ("full_rank_gate_false", {"use_full_rank_gate": False}),
    ("attn_res_block_null", {"attn_res_block_size": None}),
    ("no_kv_heads", {"num_key_value_heads": ...}),
    ("no_mla_use_nope", {"mla_use_nope": ...}),
]


@pytest.mark.parametrize("changes", [h[1] for h in HARMLESS], ids=[h[0] for h in HARMLESS])
def test_default_valued_fields_load(changes: dict[str, Any]) -> None:
    c = ModelConfig.from_dict(with_changes(kimi_linear_48b(), changes))
    assert c == ModelConfig.from_dict(kimi_linear_48b())


# ---- Kimi K3: the kimi_k3 wrapper and its text fields ----

def k3_config() -> dict[str, Any]:
    """K3's released config.json (k3_spec.md 3), its vision_config cut to one field."""
    lac = {"kda_layers": [i for i in range(1, 92) if i % 4], "full_attn_layers":
           list(range(4, 93, 4)) + [93], "head_dim": 128, "num_heads": 96,
           "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": True}
    text = {"model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 7168,
            "num_hidden_layers": 93, "num_attention_heads": 96, "num_key_value_heads": 96,
            "intermediate_size": 33792, "first_k_dense_replace": 1, "moe_layer_freq": 1,
            "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2,
            "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584,
            "latent_moe_use_norm": True, "moe_router_activation_func": "sigmoid",
            "topk_method": "noaux_tc", "use_grouped_topk": True, "num_expert_group": 1,
            "topk_group": 1, "moe_renormalize": True, "routed_scaling_factor": 1.0,
            "hidden_act": "situ", "activation_situ_beta": 4.0,
            "activation_situ_linear_beta": 25.0, "attn_res_block_size": 12,
            "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
            "mla_use_output_gate": True, "num_nextn_predict_layers": 0, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False, "linear_attn_config": lac}
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
            "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
            "text_config": text, "vision_config": {"model_type": "moonvit3d"}}


def test_k3_config_reads_every_field() -> None:
    c = ModelConfig.from_dict(k3_config())
    assert (c.num_hidden_layers, len(c.kda_layers), len(c.mla_layers)) == (93, 69, 24)
    assert c.mla_layers[-2:] == [91, 92] and c.layer_types[:4] == ("kda",) * 3 + ("mla",)
    assert c.mlp_types[0] == DENSE and set(c.mlp_types[1:]) == {MOE}
    assert (c.hidden_act, c.situ_beta, c.situ_linear_beta) == ("situ", 4.0, 25.0)
    assert (c.attn_res_block_size, c.routed_expert_hidden_size, c.latent_moe_use_norm) == \
        (12, 3584, True)
    assert (c.kda_gate_lower_bound, c.kda_full_rank_gate, c.mla_use_output_gate) == \
        (-5.0, True, True)
    assert (c.num_experts, c.num_experts_per_token, c.num_shared_experts) == (896, 16, 2)
    assert (c.q_lora_rank, c.routed_scaling_factor) == (1536, 1.0)
    assert (c.bos_token_id, c.eos_token_ids, c.pad_token_id) == (163584, (163586,), 163839)
    assert c.tensor_prefix == "language_model." and c.has_vision_tower
    assert c.kernel_features == {"kda_lower_bound", "situ"} and c.has_k3_layers


K3_UNSUPPORTED: list[tuple[str, str, Any]] = [
    ("num_nextn_predict_layers", "num_nextn_predict_layers", 1),
    ("mla_use_nope", "mla_use_nope", False),
    ("hidden_act", "hidden_act", "swiglu"),
    ("topk_method", "topk_method", "group_limited_greedy"),
    ("moe_router_activation_func", "moe_router_activation_func", "tanh"),
]


@pytest.mark.parametrize("field_name,key,value", K3_UNSUPPORTED,
                         ids=[u[0] for u in K3_UNSUPPORTED])
def test_k3_value_we_do_not_implement_names_field_and_value(field_name: str, key: str,
                                                             value: Any) -> None:
    raw = k3_config()
    raw["text_config"][key] = value
    with pytest.raises(ValueError, match=f"{field_name}.*{value!r}".replace("(", r"\(")):
        ModelConfig.from_dict(raw)


def test_k3_preset_round_trips_through_the_hub_schema() -> None:
    c = preset_config("k3-tiny")
    hub = hub_dict(c)
    assert hub["model_type"] == "kimi_k3" and "text_config" in hub
    assert ModelConfig.from_dict(hub) == c


# ---- clear errors for malformed configs ----

BAD: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("missing_vocab", {"vocab_size": ...}, ValueError, "'vocab_size' is missing"),
    ("missing_hidden", {"hidden_size": None}, ValueError, "'hidden_size' is missing"),
    ("missing_layers", {"num_hidden_layers": ...}, ValueError, "'num_hidden_layers' is missing"),
    ("missing_heads", {"num_attention_heads": ...}, ValueError,
     "'num_attention_heads' is missing"),
    ("zero_based_lists",
     {"linear_attn_config.kda_layers": [i - 1 for i in KDA_LAYERS_1],
      "linear_attn_config.full_attn_layers": MLA_LAYERS_0},
     ValueError, r"kda_layers has 0, outside 1\.\.27 \(the lists are 1-indexed\)"),
    ("layer_past_end", {"linear_attn_config.full_attn_layers": FULL_ATTN_LAYERS_1[:-1] + [28]},
     ValueError, r"full_attn_layers has 28, outside 1\.\.27"),
    ("layer_in_neither", {"linear_attn_config.kda_layers": KDA_LAYERS_1[1:]}, ValueError,
     r"layers \[0\] \(0-indexed\) are in neither"),
    ("layer_in_both", {"linear_attn_config.kda_layers": KDA_LAYERS_1 + [27]}, ValueError,
     r"layer 26 \(0-indexed\) is in both kda_layers and full_attn_layers"),
    ("no_layer_lists", {"linear_attn_config.kda_layers": ...}, ValueError,
     "neither layer_types nor"),
    ("router_relu", {"moe_router_activation_func": "relu"}, ValueError,
     "moe_router_activation_func='relu'"),
    ("topk_gt_experts", {"num_experts_per_token": 300}, ValueError,
     "num_experts_per_token=300 > num_experts=256"),
    ("groups_not_dividing", {"num_expert_group": 3, "topk_group": 1}, ValueError,
     "num_expert_group=3"),
    ("topk_group_gt_groups", {"num_expert_group": 4, "topk_group": 5}, ValueError,
     "topk_group=5 > num_expert_group=4"),
]


@pytest.mark.parametrize("changes,exc,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_malformed_config_error(changes: dict[str, Any], exc: type[Exception],
                                message: str) -> None:
    with pytest.raises(exc, match=message):
        ModelConfig.from_dict(with_changes(kimi_linear_48b(), changes))


def test_mismatched_type_lists_rejected_by_dataclass() -> None:
    c = ModelConfig.from_dict(kimi_linear_48b())
    with pytest.raises(ValueError, match="26 layer types for num_hidden_layers=27"):
        replace(c, layer_types=c.layer_types[:-1])
    with pytest.raises(ValueError, match="unknown attention type 'swa'"):
        replace(c, layer_types=c.layer_types[:-1] + ("swa",))


# ---- hub_dict: the writer of `make-checkpoint` ----

@pytest.mark.parametrize("name", sorted(PRESETS))
def test_hub_dict_round_trip(name: str) -> None:
    c = preset_config(name)
    hub = hub_dict(c)
    assert ModelConfig.from_dict(hub) == c
    # JSON-serialisable and 1-indexed like Moonshot's files
    assert ModelConfig.from_dict(json.loads(json.dumps(hub))) == c
    lac = hub.get("text_config", hub)["linear_attn_config"]
    assert sorted(lac["kda_layers"] + lac["full_attn_layers"]) == list(
        range(1, c.num_hidden_layers + 1))


@pytest.mark.parametrize(
    "overrides",
    [{"eos_token_ids": (7, 8)}, {"q_lora_rank": 48}, {"tie_word_embeddings": True},
     {"router_activation": "softmax", "moe_renormalize": False}, {"checkpoint_dtype": "float32"}],
    ids=["two_eos", "q_lora", "tied", "softmax_router", "fp32"],
)
def test_hub_dict_round_trip_variants(overrides: dict[str, Any]) -> None:
    c = preset_config("tiny", **overrides)
    assert ModelConfig.from_dict(hub_dict(c)) == c


def test_hub_dict_round_trip_48b() -> None:
    c = ModelConfig.from_dict(kimi_linear_48b())
    hub = hub_dict(c)
    assert hub["linear_attn_config"]["kda_layers"] == KDA_LAYERS_1
    assert hub["linear_attn_config"]["full_attn_layers"] == FULL_ATTN_LAYERS_1
    assert ModelConfig.from_dict(hub) == c


def test_kimi_shaped_preset_has_kimi_linears_tensor_shapes() -> None:
    """The GPU preset's layers are Kimi-Linear-48B's (../shared/docs/kda_spec.md), in 4
    layers: a dense KDA layer, MoE KDA layers, an MoE MLA layer."""
    from kdaserve.checkpoint import checkpoint_shapes

    c = preset_config("kimi-shaped")
    assert c.layer_types == ("kda", "kda", "kda", "mla")
    assert c.mlp_types == ("dense", "moe", "moe", "moe")
    shapes = checkpoint_shapes(c)
    kda, mla, moe = "model.layers.1.self_attn.", "model.layers.3.self_attn.", \
        "model.layers.3.block_sparse_moe."
    want = {kda + "q_proj.weight": (4096, 2304), kda + "f_a_proj.weight": (128, 2304),
            kda + "b_proj.weight": (32, 2304), kda + "o_proj.weight": (2304, 4096),
            mla + "q_proj.weight": (6144, 2304), mla + "kv_a_proj_with_mqa.weight": (576, 2304),
            mla + "o_proj.weight": (2304, 4096), moe + "gate.weight": (256, 2304),
            moe + "experts.255.w1.weight": (1024, 2304), moe + "experts.0.w2.weight": (2304, 1024),
            moe + "shared_experts.down_proj.weight": (2304, 1024),
            "model.layers.0.mlp.gate_proj.weight": (9216, 2304)}
    assert {k: tuple(shapes[k]) for k in want} == want


def test_vision_config_reads_the_released_schema_and_refuses_the_rest() -> None:
    """K3's vision_config: the released values by default, the writer's schema read back,
    and every fixed choice other than K3's refused by name."""
    from kdaserve.vision_config import VisionConfig

    c = VisionConfig.from_dict({"model_type": "moonvit3d"}, 7168)
    assert (c.hidden_size, c.num_layers, c.head_dim, c.media_pad_id) == (1024, 27, 128, 163605)
    small = VisionConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128,
                         qkv_hidden_size=96, mm_hidden_size=64, text_hidden_size=64)
    assert VisionConfig.from_dict(small.to_dict(), 64) == small
    for key, value in (("merge_type", "tpool"), ("norm_type", "layernorm"),
                       ("attn_bias", True), ("merge_kernel_size", [3, 3])):
        with pytest.raises(ValueError, match=key):
            VisionConfig.from_dict({key: value}, 7168)
    with pytest.raises(ValueError, match="text_hidden_size"):
        VisionConfig.from_dict({"text_hidden_size": 4096}, 7168)
    with pytest.raises(ValueError, match="mm_hidden_size"):
        VisionConfig.from_dict({"mm_hidden_size": 512}, 7168)
