"""Random-weight checkpoints in Moonshot's hub format (`kdaserve make-checkpoint`).

Presets: `tiny` and `small` for tests (q_lora_rank null / set, one / several expert groups),
`bench` shaped like Kimi-Linear-48B scaled down (head dims 128, 3 KDA : 1 MLA, dense first layer,
64 experts top-8 + shared, ~314M parameters), which is also the built-in default model.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kdaserve.config import DENSE, KDA, MLA, MOE, ModelConfig
from kdaserve.hub_writer import hub_dict
from kdaserve.kernels import resolve_kernels
from kdaserve.layers.parallel import full_shape
from kdaserve.models.kimi_linear import KimiLinearForCausalLM
from kdaserve.models.loader import random_tensor
from kdaserve.models.vision import VisionModel
from kdaserve.tokenizer import K3_SPECIAL_NAMES
from kdaserve.tokenizer_writer import (
    added_tokens_decoder,
    write_hf_tokenizer_json,
    write_kimi_tokenizer,
)
from kdaserve.vision_config import VisionConfig

NUM_SPECIAL = 256
FP32_TENSORS = ("A_log", "dt_bias")
FP32_IN_K3 = FP32_TENSORS + ("e_score_correction_bias", "conv1d.weight", "o_norm.weight")
RANDOM_MARKER = "RANDOM_WEIGHTS.txt"  # so servers can say so at start-up


def _layers(n: int) -> tuple[str, ...]:
    # 3 KDA : 1 MLA, the last layer always MLA (as Kimi-Linear-48B's last group)
    return tuple(MLA if (i + 1) % 4 == 0 or i == n - 1 else KDA for i in range(n))


def k3_layer_types(n: int) -> tuple[str, ...]:
    # K3's 1-based lists: MLA every 4th layer, and the last two layers both MLA
    return tuple(MLA if (i + 1) % 4 == 0 or i >= n - 2 else KDA for i in range(n))


def _k3_preset(num_base: int, layers: int, hidden: int, **kw: Any) -> dict[str, Any]:
    """K3's text model (k3_spec.md 3.2) scaled down: its fields and ratios (latent = hidden
    / 2, two shared experts run as one MLP, scaling 1.0, the gate bound, SiTU's betas)."""
    return _preset(num_base, layers, hidden_size=hidden, layer_types=k3_layer_types(layers),
                   num_shared_experts=2, routed_scaling_factor=1.0, hidden_act="situ",
                   situ_beta=4.0, situ_linear_beta=25.0, routed_expert_hidden_size=hidden // 2,
                   latent_moe_use_norm=True, mla_use_output_gate=True,
                   kda_gate_lower_bound=-5.0, kda_full_rank_gate=True,
                   tensor_prefix="language_model.", **kw)


def _preset(num_base: int, layers: int, **kw: Any) -> dict[str, Any]:
    base = {
        "vocab_size": num_base + NUM_SPECIAL, "num_hidden_layers": layers,
        "layer_types": _layers(layers), "mlp_types": (DENSE,) + (MOE,) * (layers - 1),
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "kda_conv_size": 4, "router_activation": "sigmoid", "moe_renormalize": True,
        "routed_scaling_factor": 2.446, "num_shared_experts": 1, "bos_token_id": num_base,
        "eos_token_ids": (num_base + 2,), "pad_token_id": num_base + 255,
    }
    base.update(kw)
    return base


# <|media_pad|>'s place among K3's 256 specials (its id is the base vocabulary plus this)
MEDIA_PAD_OFFSET = {name: o for o, name in K3_SPECIAL_NAMES.items()}["<|media_pad|>"]

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": _preset(
        3840, 4, hidden_size=64, intermediate_size=128, kda_num_heads=2, kda_head_dim=32,
        num_attention_heads=2, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, num_experts=8, num_experts_per_token=2,
        moe_intermediate_size=32, num_expert_group=1, topk_group=1),
    "small": _preset(
        16128, 8, hidden_size=128, intermediate_size=256, kda_num_heads=4, kda_head_dim=32,
        num_attention_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, num_experts=16, num_experts_per_token=4,
        moe_intermediate_size=64, num_expert_group=4, topk_group=2),
    "bench": _preset(
        100256, 8, hidden_size=768, intermediate_size=2048, kda_num_heads=6, kda_head_dim=128,
        num_attention_heads=6, q_lora_rank=None, kv_lora_rank=256, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, num_experts=64, num_experts_per_token=8,
        moe_intermediate_size=128, num_expert_group=1, topk_group=1),
    # Kimi-Linear-48B's layer shapes (docs: ../shared/docs/kda_spec.md) in 4 layers (a dense
    # KDA layer, two MoE KDA layers, an MoE MLA layer): per-layer GPU numbers that mean
    # something. 6.1B parameters (12 GB in bf16): for a GPU machine, not for the tests.
    "kimi-shaped": _preset(
        100256, 4, hidden_size=2304, intermediate_size=9216, kda_num_heads=32,
        kda_head_dim=128, num_attention_heads=32, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_experts=256,
        num_experts_per_token=8, moe_intermediate_size=1024, num_expert_group=1,
        topk_group=1),
    # K3 for tests: an AttnRes block boundary inside the model (blocks of 3 in 7 layers), the
    # last two layers MLA, KDA's A_log stored longer than its 2 heads (as K3's [128] for 96)
    "k3-tiny": _k3_preset(
        3840, 7, 64, intermediate_size=128, kda_num_heads=2, kda_head_dim=32,
        num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, num_experts=16, num_experts_per_token=4,
        moe_intermediate_size=32, num_expert_group=1, topk_group=1, attn_res_block_size=3),
    # k3-tiny with a tiny vision tower in the released format (tower 2 blocks of width 64,
    # attention 2 heads of 48, an 8 x 8 position grid; <|media_pad|> at K3's offset)
    "k3-tiny-vl": _k3_preset(
        3840, 7, 64, intermediate_size=128, kda_num_heads=2, kda_head_dim=32,
        num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, num_experts=16, num_experts_per_token=4,
        moe_intermediate_size=32, num_expert_group=1, topk_group=1, attn_res_block_size=3,
        vision=VisionConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128,
                            qkv_hidden_size=96, pos_emb_height=8, pos_emb_width=8,
                            mm_hidden_size=64, text_hidden_size=64,
                            media_pad_id=3840 + MEDIA_PAD_OFFSET)),
    # K3 for tests at the suite's widest (hidden 128): 10 layers in AttnRes blocks of 4, 32
    # experts top-8, a KDA head count whose A_log is stored longer
    "k3-small": _k3_preset(
        16128, 10, 128, intermediate_size=256, kda_num_heads=4, kda_head_dim=32,
        num_attention_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, num_experts=32, num_experts_per_token=8,
        moe_intermediate_size=64, num_expert_group=1, topk_group=1, attn_res_block_size=4),
    # the CPU benchmark model with K3's ratios, `bench`'s size: hidden 768 with a latent of
    # 384, 96 experts with top-16 (K3: 896, top-16), AttnRes blocks of 3 in 8 layers (K3: 12
    # in 93), MLA at layers 4, 7 and 8 (the last two, as K3's)
    "k3-bench": _k3_preset(
        100256, 8, 768, intermediate_size=2048, kda_num_heads=6, kda_head_dim=128,
        num_attention_heads=6, q_lora_rank=192, kv_lora_rank=256, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, num_experts=96, num_experts_per_token=16,
        moe_intermediate_size=192, num_expert_group=1, topk_group=1, attn_res_block_size=3),
    # k3-bench with K3's own vision tower (27 blocks of width 1024, attention 12 x 128, MLP
    # 4096: 0.4B parameters), its projector into k3-bench's width: the images benchmark
    "k3-bench-vl": _k3_preset(
        100256, 8, 768, intermediate_size=2048, kda_num_heads=6, kda_head_dim=128,
        num_attention_heads=6, q_lora_rank=192, kv_lora_rank=256, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, num_experts=96, num_experts_per_token=16,
        moe_intermediate_size=192, num_expert_group=1, topk_group=1, attn_res_block_size=3,
        vision=VisionConfig(text_hidden_size=768, media_pad_id=100256 + MEDIA_PAD_OFFSET)),
    # K3's real per-layer shapes (k3_spec.md 3.2) in 4 layers (a dense KDA layer, an MoE KDA
    # layer, two MoE MLA layers), for per-layer numbers on a GPU; the routed experts cut to
    # 128 of 896 (same shapes, same top-16) so that it fits one GPU in bf16: 17.7B parameters, 35 GB
    "k3-shaped": _k3_preset(
        163584, 4, 7168, intermediate_size=33792, kda_num_heads=96, kda_head_dim=128,
        num_attention_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, num_experts=128, num_experts_per_token=16,
        moe_intermediate_size=3072, num_expert_group=1, topk_group=1, attn_res_block_size=12),
}


def preset_config(name: str, **overrides: Any) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return replace(ModelConfig(**PRESETS[name]), **overrides)


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = KimiLinearForCausalLM(config, resolve_kernels(
            torch.device("cpu"), features=config.kernel_features))
    shapes = {name: full_shape(t) for name, t in model.checkpoint_tensors().items()
              if t is not None}
    if config.vision is not None:
        with torch.device("meta"):
            vision = VisionModel(config.vision)
        shapes.update({n: tuple(t.shape) for n, t in vision.checkpoint_tensors().items()})
    return shapes


def make_checkpoint(out: str | Path, preset: str | ModelConfig = "tiny", seed: int = 0,
                    dtype: str = "bfloat16", num_shards: int = 1,
                    with_tokenizer: bool = True, tokenizer: str | Path | None = None,
                    extra_special_tokens: tuple[str, ...] = (),
                    chat_template: str | Path | None = None,
                    expert_format: str | None = None) -> Path:
    """Writes config.json, safetensors (sharded with an index when num_shards > 1) and, unless
    disabled, a Kimi-format tokenizer. Every tensor is random, decay and router bias included.

    `tokenizer`: a tokenizer folder to ship instead (e.g. the real Kimi tokenizer); the model's
    vocabulary and BOS/EOS/PAD ids then come from it, and `extra_special_tokens` get free
    reserved ids in its config (K3's `<|open|>`... tags on K2's tokenizer). `chat_template`: a
    Jinja file saved as the checkpoint's `chat_template.jinja`. `expert_format="mxfp4"`: the
    routed experts written as K3 ships them (packed MXFP4 with E8M0 scales, the
    compressed-tensors quantization_config in config.json): the same random weights,
    quantized."""
    config = preset if isinstance(preset, ModelConfig) else preset_config(preset)
    config = replace(config, checkpoint_dtype=dtype,
                     expert_format=expert_format or config.expert_format)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:
        config = copy_tokenizer(Path(tokenizer), out, config, extra_special_tokens)
    elif extra_special_tokens:
        raise ValueError("extra special tokens need a tokenizer folder")
    if chat_template is not None:
        shutil.copyfile(chat_template, out / "chat_template.jinja")
    torch_dtype = getattr(torch, dtype)
    shapes = checkpoint_shapes(config)
    names = list(shapes)
    shard_size = -(-len(names) // num_shards)
    weight_map: dict[str, str] = {}
    for s in range(num_shards):
        part = names[s * shard_size:(s + 1) * shard_size]
        fname = ("model.safetensors" if num_shards == 1
                 else f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors")
        tensors = {}
        for name in part:
            t = random_tensor(name, shapes[name], seed)
            # A_log and dt_bias are fp32 in Moonshot's checkpoints, everything else bf16 (K3
            # also keeps the router bias, the short convs and KDA's output norm fp32)
            keep_fp32 = name.endswith(FP32_IN_K3 if config.tensor_prefix else FP32_TENSORS)
            tensors[name] = t if keep_fp32 or not t.is_floating_point() else t.to(torch_dtype)
            weight_map[name] = fname
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
    if num_shards > 1:
        with open(out / "model.safetensors.index.json", "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    (out / RANDOM_MARKER).write_text(
        f"Random weights written by `kdaserve make-checkpoint` (preset/config above, seed "
        f"{seed}): for tests and benchmarks; the text this model generates is meaningless.\n")
    hub = hub_dict(config)
    if with_tokenizer and tokenizer is None:
        layout = "k3" if config.tensor_prefix else "k2"  # K3's special ids (k3_spec.md 6.2)
        write_kimi_tokenizer(out, config.vocab_size - NUM_SPECIAL, layout=layout)
        # tokenizer.json twin for tools that read only HF fast tokenizers (llama.cpp)
        write_hf_tokenizer_json(out, config.vocab_size - NUM_SPECIAL, layout=layout)
    with open(out / "config.json", "w") as f:
        json.dump(hub, f, indent=2)
    return out


def copy_tokenizer(src: Path, out: Path, config: ModelConfig,
                   extra_special_tokens: tuple[str, ...]) -> ModelConfig:
    """Copies a tokenizer folder's files into `out`, declaring `extra_special_tokens` at the
    lowest unused reserved ids; returns `config` with the tokenizer's vocabulary and ids."""
    from kdaserve.tokenizer import CONFIG_FILE, Tokenizer

    for name in ("tiktoken.model", "tokenizer.json", CONFIG_FILE):
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    tok = Tokenizer.from_pretrained(out)  # also checks the folder holds a tokenizer
    if config.tensor_prefix:
        # K3: its layout of the reserved ids (the shared folder's config is K2's), its stop
        # token; the ranks are the same
        cfg_path = out / CONFIG_FILE
        cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        cfg["added_tokens_decoder"] = added_tokens_decoder(tok.vocab_size - NUM_SPECIAL, "k3")
        cfg["eos_token"] = "<|end_of_msg|>"
        cfg.pop("additional_special_tokens", None)
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n",
                            encoding="utf-8")
        (out / "tokenizer.json").unlink(missing_ok=True)  # a K2 twin would disagree
        tok = Tokenizer.from_pretrained(out)
    if extra_special_tokens:
        cfg_path = out / CONFIG_FILE
        cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        decoder = cfg.setdefault("added_tokens_decoder", {})
        names = tok.special_tokens
        # a reserved placeholder, declared as such or not declared at all
        free = iter(i for n, i in sorted(names.items(), key=lambda kv: kv[1])
                    if n.startswith("<|reserved_token_"))
        for name in extra_special_tokens:
            if name in names and not name.startswith("<|reserved_token_"):
                continue
            token_id = next(free, None)
            if token_id is None:
                raise ValueError(f"no reserved token id left for {name!r}")
            decoder[str(token_id)] = {"content": name, "lstrip": False, "normalized": False,
                                      "rstrip": False, "single_word": False, "special": True}
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n",
                            encoding="utf-8")
        tok = Tokenizer.from_pretrained(out)
    specials = tok.special_tokens
    return replace(config, vocab_size=tok.vocab_size, bos_token_id=tok.bos_token_id,
                   eos_token_ids=tuple(tok.eos_token_ids),
                   pad_token_id=specials.get("[PAD]", config.pad_token_id))


def default_model_path(preset: str = "bench", seed: int = 0) -> Path:
    """The built-in default model: a random `preset` checkpoint generated once into a cache."""
    cache = Path(os.environ.get("KDASERVE_CACHE", Path.home() / ".cache" / "kdaserve"))
    path = cache / f"{preset}-seed{seed}"
    if not (path / "config.json").is_file():  # config.json is written last: marks completion
        print(f"[kdaserve] generating random-weight '{preset}' checkpoint into {path} "
              "(random weights: output text is meaningless)", flush=True)
        make_checkpoint(path, preset, seed=seed)
    return path


def resolve_model_path(model: str | os.PathLike) -> os.PathLike:
    """A checkpoint folder, or a preset name for the built-in random-weight checkpoints."""
    path = Path(model)
    if path.is_dir():
        return path
    if str(model) in PRESETS:
        return default_model_path(str(model))
    raise ValueError(f"model {str(model)!r} is neither a checkpoint folder nor a preset "
                     f"({', '.join(sorted(PRESETS))})")
