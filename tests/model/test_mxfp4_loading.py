"""Loading K3's MXFP4 experts: the quantization_config read field by field (anything but
compressed-tensors' mxfp4-pack-quantized refused, naming the field and value), packing read
per tensor (a packed tensor outside the routed experts, packed experts without the config,
float experts under it: each refused by name), the experts held packed at about 0.53 bytes a
parameter, and `load_format="dummy"` and tensor parallelism giving the same packed values."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kdaserve import LLM, RequestOptions, SamplingParams
from kdaserve.checkpoint import make_checkpoint
from kdaserve.config import ModelConfig
from kdaserve.hub_schema import MXFP4_CONFIG, expert_format_of
from kdaserve.kernels import resolve_kernels
from kdaserve.layers.moe import MoE
from kdaserve.layers.parallel import TensorParallel
from kdaserve.models.loader import build_model


@pytest.fixture(scope="module")
def mxfp4_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("k3-mxfp4"), "k3-tiny", seed=3,
                           expert_format="mxfp4")


def _with(path: dict, value: object) -> dict:
    q = copy.deepcopy(MXFP4_CONFIG)
    *keys, last = path
    node = q
    for k in keys:
        node = node[k]
    node[last] = value
    return q


@pytest.mark.parametrize("path,value,field", [
    (("format",), "nvfp4-pack-quantized", "format"),
    (("quant_method",), "fp8", "quant_method"),
    (("config_groups", "group_0", "weights", "group_size"), 16, "group_size"),
    (("config_groups", "group_0", "weights", "num_bits"), 8, "num_bits"),
    (("config_groups", "group_0", "weights", "scale_dtype"), "torch.float16", "scale_dtype"),
    (("config_groups", "group_0", "weights", "symmetric"), False, "symmetric"),
    (("config_groups", "group_0", "input_activations"), {"num_bits": 8}, "input_activations"),
    (("kv_cache_scheme",), {"num_bits": 8}, "kv_cache_scheme"),
])
def test_other_quantizations_are_refused_by_name(path: tuple, value: object, field: str) -> None:
    assert expert_format_of({"quantization_config": MXFP4_CONFIG}) == "mxfp4"
    with pytest.raises(ValueError, match=f"{field}.*{value!r}".replace("(", r"\(")):
        expert_format_of({"quantization_config": _with(path, value)})


def _rewrite(src: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:  # noqa: ANN001
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors" and edit_tensors is not None:
            tensors = load_file(str(f))
            edit_tensors(tensors)
            save_file(tensors, str(dst / f.name))
        elif f.name == "config.json" and edit_config is not None:
            config = json.loads(f.read_text())
            edit_config(config)
            (dst / f.name).write_text(json.dumps(config))
        else:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_packing_is_read_per_tensor(mxfp4_ckpt: Path, k3_ckpt: Path, tmp_path: Path) -> None:
    def pack_a_norm(t: dict) -> None:
        t["language_model.model.norm.weight_packed"] = torch.zeros(32, dtype=torch.uint8)

    bad = _rewrite(mxfp4_ckpt, tmp_path / "a", edit_tensors=pack_a_norm)
    with pytest.raises(ValueError, match="outside the routed experts"):
        LLM(bad)
    no_config = _rewrite(mxfp4_ckpt, tmp_path / "b", edit_config=lambda c: c[
        "text_config"].pop("quantization_config"))
    with pytest.raises(ValueError, match="no MXFP4 quantization_config"):
        LLM(no_config)
    # float experts (k3_ckpt is k3-tiny too) under an MXFP4 config
    float_experts = _rewrite(k3_ckpt, tmp_path / "c", edit_config=lambda c: c[
        "text_config"].update(quantization_config=MXFP4_CONFIG))
    with pytest.raises(ValueError, match="routed experts are MXFP4"):
        LLM(float_experts)

    def codes_as_float(t: dict) -> None:
        name = next(n for n in t if n.endswith("w1.weight_packed"))
        t[name] = t[name].float()

    with pytest.raises(ValueError, match="dtype F32, expected torch.uint8"):
        LLM(_rewrite(mxfp4_ckpt, tmp_path / "d", edit_tensors=codes_as_float))


def test_experts_held_packed_and_dummy_and_tp_agree(mxfp4_ckpt: Path) -> None:
    config = ModelConfig.from_pretrained(mxfp4_ckpt)
    assert config.expert_format == "mxfp4"
    cpu = torch.device("cpu")
    kernels = resolve_kernels(cpu, features=config.kernel_features)
    loaded = build_model(config, kernels, torch.float32, cpu, mxfp4_ckpt)
    dummy = build_model(config, kernels, torch.float32, cpu, None, load_format="dummy", seed=3)
    moes = [m for m in loaded.modules() if isinstance(m, MoE)]
    for m, d in zip(moes, (m for m in dummy.modules() if isinstance(m, MoE)), strict=True):
        assert torch.equal(m.w13, d.w13) and torch.equal(m.w2_scale, d.w2_scale)
        params = m.w13.numel() * 2 + m.w2.numel() * 2
        held = sum(t.numel() for t in (m.w13, m.w2, m.w13_scale, m.w2_scale))
        assert held / params == pytest.approx(0.5 + 1 / 32)  # 0.53 bytes a parameter
    # two TP ranks hold the packed rows and scale columns of their intermediate shares
    # (moe_intermediate_size 32 is one scale group: a TP rank's 16 would split it)
    with pytest.raises(ValueError, match="multiple of 32"):
        build_model(config, kernels, torch.float32, cpu, mxfp4_ckpt, tp=TensorParallel(0, 2))


def test_quantization_mxfp4_packs_as_shipped(k3_ckpt: Path, tmp_path: Path) -> None:
    """`--quantization mxfp4` packs a float checkpoint's experts at load: the same bytes, so
    the same logits, as the checkpoint written with those experts packed."""
    shipped = make_checkpoint(tmp_path / "shipped", "k3-tiny", seed=3, dtype="float32",
                              expert_format="mxfp4")
    packed_at_load = LLM(k3_ckpt, quantization="mxfp4")
    moe = packed_at_load.model.layers[1].mlp
    assert moe.w13.dtype == moe.w13_scale.dtype == torch.uint8
    ids = [5, 99, 7, 1000, 42, 3]
    assert torch.equal(packed_at_load.prefill_logits(ids), LLM(shipped).prefill_logits(ids))


def test_quantization_mxfp4_on_kimi_linear(tiny_ckpt: Path, tmp_path: Path) -> None:
    """Kimi Linear's experts packed too (SwiGLU in the MXFP4 kernel): the native kernels give
    the plain-torch reference's tokens; widths that split a scale group are refused."""
    from kdaserve import SamplingParams
    from kdaserve.checkpoint import preset_config

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 9, 17, 33], list(range(40, 90))]
    fast = LLM(tiny_ckpt, quantization="mxfp4")
    ref = LLM(tiny_ckpt, quantization="mxfp4", kernel_backend="ref")
    assert fast.model.layers[1].mlp.w13.dtype == torch.uint8
    assert [o.token_ids for o in fast.generate(prompt_token_ids=prompts, sampling_params=params)] \
        == [o.token_ids for o in ref.generate(prompt_token_ids=prompts, sampling_params=params)]
    odd = make_checkpoint(tmp_path / "odd", preset_config("tiny", moe_intermediate_size=24))
    with pytest.raises(ValueError, match="moe_intermediate_size = 24"):
        LLM(odd, quantization="mxfp4")


def test_pd_fingerprint_and_routing_replay_see_the_format(k3_ckpt: Path,
                                                          mxfp4_ckpt: Path) -> None:
    """The PD pool fingerprint tells MXFP4 experts from float ones of the same checkpoint (a
    float decode server must not take a packed prefill server's caches), and routed-experts
    replay on packed experts records the router's choices, as a plain forward's hooks see."""
    from kdaserve import SamplingParams
    from kdaserve.engine.disaggregation.layout import model_fingerprint

    def fingerprint(llm: LLM) -> str:
        return model_fingerprint(dataclasses.asdict(llm.engine.model_config), llm.model)

    floats, packed = LLM(k3_ckpt), LLM(k3_ckpt, quantization="mxfp4")
    assert fingerprint(floats) != fingerprint(packed)
    assert fingerprint(packed) == fingerprint(LLM(k3_ckpt, quantization="mxfp4"))
    llm = LLM(mxfp4_ckpt)
    ids = [5, 99, 7, 1000, 42, 3, 8, 8]
    out = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True),
        options=RequestOptions(return_routed_experts=True))[0]
    got = out.outputs[0].routed_experts
    seen: list[torch.Tensor] = []

    def hook(mod: MoE, inp: tuple[torch.Tensor, ...], _: torch.Tensor) -> None:
        c = mod.config
        logits = torch.nn.functional.linear(inp[0].float(), mod.gate_weight)
        seen.append(mod.kernels.moe_route(
            logits, mod.e_score_correction_bias, c.num_experts_per_token, c.num_expert_group,
            c.topk_group, c.moe_renormalize, c.routed_scaling_factor,
            c.router_activation)[1].to(torch.int32))

    handles = [m.register_forward_hook(hook) for m in llm.model.modules() if isinstance(m, MoE)]
    try:
        llm.prefill_logits(ids + out.token_ids[:-1])
    finally:
        for h in handles:
            h.remove()
    want = torch.stack(seen, 1)
    assert got is not None and torch.equal(got.sort(-1).values, want.sort(-1).values)


def test_rl_updates_to_packed_experts(tmp_path: Path) -> None:
    """A served MXFP4 checkpoint takes a trainer's float expert weights under their own names
    (packed on arrival) or the packed tensors under the released names: either way it then
    decodes as the checkpoint those weights were packed into. Floats sent as codes, or codes
    as floats, are refused."""
    from kdaserve import SamplingParams

    from .conftest import serialize

    def tensors(path: Path) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for f in sorted(path.glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 9, 17, 33], list(range(40, 70))]
    serving = make_checkpoint(tmp_path / "a", "k3-tiny", seed=3, dtype="float32",
                              expert_format="mxfp4")
    floats = make_checkpoint(tmp_path / "b", "k3-tiny", seed=8, dtype="float32")
    packed = make_checkpoint(tmp_path / "c", "k3-tiny", seed=8, dtype="float32",
                             expert_format="mxfp4")
    want = [o.token_ids for o in LLM(packed).generate(prompt_token_ids=prompts,
                                                       sampling_params=params)]
    for source in (floats, packed):
        llm = LLM(serving)
        llm.engine.rl.update_weights_from_tensor([serialize(list(tensors(source).items()))])
        assert [o.token_ids for o in llm.generate(prompt_token_ids=prompts,
                                                  sampling_params=params)] == want
    codes = next(n for n in tensors(packed) if n.endswith("w1.weight_packed"))
    llm = LLM(serving)
    with pytest.raises(ValueError, match="uint8"):
        llm.engine.rl.update_weights_from_tensor([serialize([(codes, torch.zeros(
            tensors(packed)[codes].shape))])])
    with pytest.raises(ValueError, match="packed to MXFP4 from a float"):
        llm.engine.rl.update_weights_from_tensor([serialize([(
            codes.removesuffix("_packed"), tensors(packed)[codes])])])


def test_deterministic_inference_with_mxfp4_experts(mxfp4_ckpt: Path) -> None:
    """The batch-invariant experts decode MXFP4 rows exactly: a request's tokens and logprobs
    are the same bits alone and among others, at other chunk budgets, and the greedy tokens
    are the plain engine's on the same packed experts."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompt = [5 + (7 * i) % 200 for i in range(37)]
    others = [[3 + (11 * i + j) % 190 for i in range(9 + 4 * j)] for j in range(6)]

    def bits(llm: LLM, batch: list[list[int]]) -> tuple:
        outs = llm.generate(prompt_token_ids=batch, sampling_params=params)
        out = outs[batch.index(prompt)].outputs[0]
        return out.token_ids, out.logprobs

    det = LLM(mxfp4_ckpt, enable_deterministic_inference=True)
    assert det.engine.model.kernels.moe_experts.__name__ == "moe_experts_bi"
    alone = bits(det, [prompt])
    assert bits(det, [*others[:3], prompt, *others[3:]]) == alone
    chunked = LLM(mxfp4_ckpt, enable_deterministic_inference=True, max_num_batched_tokens=16)
    assert bits(chunked, [others[0], prompt, others[1]]) == alone
    assert alone[0] == bits(LLM(mxfp4_ckpt), [prompt])[0]
