"""The config.json a checkpoint we write carries (`make-checkpoint`): a `ModelConfig` in
Moonshot's hub schema, the inverse of what `hub_schema` reads (tests/unit/test_config.py holds
the round trip for every preset)."""

from __future__ import annotations

from typing import Any

from kdaserve.config import ModelConfig
from kdaserve.hub_schema import MOE, MXFP4_CONFIG


def hub_dict(c: ModelConfig) -> dict[str, Any]:
    """Moonshot's hub schema for `c`: Kimi Linear's flat config, or (with a tensor prefix) K3's
    `kimi_k3` wrapper whose `text_config` holds the text model and the token ids sit on top."""
    moe_layers = [i for i, t in enumerate(c.mlp_types) if t == MOE]
    first_dense = moe_layers[0] if moe_layers else c.num_hidden_layers
    if moe_layers != list(range(first_dense, c.num_hidden_layers)):
        raise ValueError("hub schema needs MoE on every layer from first_k_dense_replace on")
    lac: dict[str, Any] = {
        "kda_layers": [i + 1 for i in c.kda_layers],
        "full_attn_layers": [i + 1 for i in c.mla_layers],
        "num_heads": c.kda_num_heads, "head_dim": c.kda_head_dim,
        "short_conv_kernel_size": c.kda_conv_size}
    eos = (list(c.eos_token_ids) if len(c.eos_token_ids) > 1
           else c.eos_token_ids[0] if c.eos_token_ids else None)
    text: dict[str, Any] = {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
        "hidden_act": c.hidden_act, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_attention_heads, "q_lora_rank": c.q_lora_rank,
        "kv_lora_rank": c.kv_lora_rank, "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim, "v_head_dim": c.v_head_dim,
        "mla_use_nope": True, "linear_attn_config": lac, "num_experts": c.num_experts,
        "num_experts_per_token": c.num_experts_per_token,
        "num_shared_experts": c.num_shared_experts,
        "moe_intermediate_size": c.moe_intermediate_size,
        "moe_router_activation_func": c.router_activation,
        "moe_renormalize": c.moe_renormalize, "routed_scaling_factor": c.routed_scaling_factor,
        "use_grouped_topk": True, "num_expert_group": c.num_expert_group,
        "topk_group": c.topk_group, "topk_method": "noaux_tc",
        "first_k_dense_replace": first_dense, "moe_layer_freq": 1,
        "num_nextn_predict_layers": 0, "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": c.tie_word_embeddings, "bos_token_id": c.bos_token_id,
        "eos_token_id": eos, "pad_token_id": c.pad_token_id,
        "torch_dtype": c.checkpoint_dtype, "use_cache": True}
    if c.hidden_act == "situ":
        text["activation_situ_beta"] = c.situ_beta
        text["activation_situ_linear_beta"] = c.situ_linear_beta
    optional = {"attn_res_block_size": c.attn_res_block_size,
                "routed_expert_hidden_size": c.routed_expert_hidden_size,
                "latent_moe_use_norm": c.latent_moe_use_norm or None,
                "mla_use_output_gate": c.mla_use_output_gate or None}
    text.update({k: v for k, v in optional.items() if v is not None})
    if c.kda_gate_lower_bound is not None:
        lac["gate_lower_bound"] = c.kda_gate_lower_bound
    if c.kda_full_rank_gate:
        lac["use_full_rank_gate"] = True
    if c.expert_format == "mxfp4":
        text["quantization_config"] = MXFP4_CONFIG
    if not c.tensor_prefix:
        return text
    # K3's released value (k3_spec.md 3.2); its MLA has no rotary, so nothing here reads it,
    # but readers of the format do (llama.cpp's converter: context_length)
    text["max_position_embeddings"] = 1048576
    if c.tensor_prefix != "language_model.":
        raise ValueError(f"no hub schema writes tensor prefix {c.tensor_prefix!r}")
    out = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
           "dtype": c.checkpoint_dtype, "tie_word_embeddings": c.tie_word_embeddings,
           "bos_token_id": c.bos_token_id, "eos_token_id": eos,
           "pad_token_id": c.pad_token_id, "text_config": text}
    if c.vision is not None:
        out["vision_config"] = c.vision.to_dict()
        out["media_placeholder_token_id"] = c.vision.media_pad_id
    return out
