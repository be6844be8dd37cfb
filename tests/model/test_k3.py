"""Kimi K3's text model against an implementation no one here wrote: mlx-lm 0.32.2's `kimi_k3`
on mlx's CPU backend, reading the same released-format checkpoint directory as it is (an
AttnRes block boundary inside the model, the last two layers MLA, A_log longer than the heads,
SiTU, LatentMoE, the lower-bound gate, the gated q-LoRA MLA, sharded with an index)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kdaserve import LLM, SamplingParams
from kdaserve.checkpoint import make_checkpoint

from .conftest import clear_prompt

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm.models.kimi_k3")
from . import mlx_k3  # noqa: E402 - after the skip


@pytest.fixture(scope="module")
def k3_llm(k3_ckpt: Path) -> LLM:
    return LLM(k3_ckpt)


@pytest.fixture(scope="module")
def mlx_model(k3_ckpt: Path):  # noqa: ANN201 - an mlx_lm model
    return mlx_k3.load(k3_ckpt)


def test_config_reads_the_released_layout(k3_llm: LLM) -> None:
    c = k3_llm.config
    assert c.tensor_prefix == "language_model." and c.attn_res_block_size == 3
    assert c.layer_types[-2:] == ("mla", "mla") and c.hidden_act == "situ"
    assert c.kernel_features == {"kda_lower_bound", "situ"}


@pytest.mark.parametrize("length", [1, 13, 40, 90])
def test_prefill_logits_match_mlx(k3_llm: LLM, mlx_model, length: int) -> None:  # noqa: ANN001
    ids = clear_prompt(k3_llm, length, seed=length)
    ours = k3_llm.prefill_logits(ids)
    ref = mlx_k3.logits(mlx_model, ids)
    diff = (ours - ref).abs().max().item()
    assert diff < 1e-4 * max(1.0, ref.abs().max().item()), f"max |logit diff| {diff:.2e}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_batched_greedy_decode_matches_mlx(k3_llm: LLM, mlx_model) -> None:  # noqa: ANN001
    """6 prompts generated together in one batch, 16 new tokens each, against mlx-lm's
    cached decode one prompt at a time."""
    prompts = [clear_prompt(k3_llm, n, seed=200 + n, continuation=16)
               for n in (1, 5, 12, 30, 47, 80)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = k3_llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == mlx_k3.greedy(mlx_model, prompt, 16)


def test_chunked_prefill_and_prefix_hits_give_plain_tokens(k3_ckpt: Path, k3_llm: LLM) -> None:
    """Prompts cut into 16-token chunks, and a second request that resumes from the prefix
    cache's KDA snapshot and MLA blocks, decode as the plain engine does."""
    base = clear_prompt(k3_llm, 70, seed=7, continuation=12)
    prompts = [base, base[:64] + [11, 12, 13]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in k3_llm.generate(prompt_token_ids=prompts,
                                                  sampling_params=params)]
    chunked = LLM(k3_ckpt, max_num_batched_tokens=16, snapshot_interval=16, block_size=16)
    got = [chunked.generate(prompt_token_ids=[p], sampling_params=params)[0]
           for p in prompts]
    assert [o.token_ids for o in got] == want
    assert got[1].num_cached_tokens >= 48  # the second prompt resumed from the cache


def test_vision_tower_needs_language_model_only(k3_ckpt: Path, tmp_path: Path,
                                                k3_llm: LLM) -> None:
    """A checkpoint whose vision tower does not load (two tensors here, one mis-shaped) is
    refused with a message naming the flag; with it, the text model loads (the vision tensors
    unread) and computes the same."""
    vl = tmp_path / "k3-vl"
    shutil.copytree(k3_ckpt, vl)
    save_file({"vision_tower.patch_embed.proj.weight": torch.zeros(8, 3, 14, 14),
               "mm_projector.post_norm.weight": torch.ones(64)},
              str(vl / "model-vision.safetensors"))
    index = json.loads((vl / "model.safetensors.index.json").read_text())
    index["weight_map"].update({"vision_tower.patch_embed.proj.weight": "model-vision.safetensors",
                                "mm_projector.post_norm.weight": "model-vision.safetensors"})
    (vl / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((vl / "config.json").read_text())
    config["vision_config"] = {"model_type": "moonvit3d", "patch_size": 14}
    (vl / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="patch_embed.proj.weight.*--language-model-only"):
        LLM(vl)
    ids = clear_prompt(k3_llm, 20, seed=5)
    text_only = LLM(vl, language_model_only=True)
    assert torch.equal(text_only.prefill_logits(ids), k3_llm.prefill_logits(ids))


def matches_mlx(llm: LLM, ref, prompts: list[list[int]]) -> None:  # noqa: ANN001
    """Each prompt's prefill logits within 1e-4 of mlx-lm's, and the batch's greedy tokens
    (generated together) equal to mlx-lm's cached decode of each alone."""
    for ids in prompts:
        ours, theirs = llm.prefill_logits(ids), mlx_k3.logits(ref, ids)
        assert (ours - theirs).abs().max().item() < 1e-4 * max(1.0, theirs.abs().max().item())
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == [mlx_k3.greedy(ref, p, 8) for p in prompts]


def test_k3_small_matches_mlx(tmp_path: Path) -> None:
    """The suite's widest K3 (hidden 128, blocks of 4 in 10 layers, 32 experts top-8), in
    fp32: prefill logits and batched greedy tokens against mlx-lm."""
    path = make_checkpoint(tmp_path / "k3-small", "k3-small", seed=5, dtype="float32")
    llm, ref = LLM(path), mlx_k3.load(path)
    prompts = [clear_prompt(llm, n, seed=n, continuation=8) for n in (9, 50)]
    matches_mlx(llm, ref, prompts)


def test_mxfp4_experts_match_mlx(tmp_path: Path) -> None:
    """K3's routed experts as they ship (compressed-tensors MXFP4: packed codes and E8M0
    scales, the quantization_config in text_config), held packed, against mlx-lm reading the
    same packed tensors: prefill logits, batched greedy tokens."""
    path = make_checkpoint(tmp_path / "k3-mxfp4", "k3-tiny", seed=3, dtype="float32",
                           expert_format="mxfp4")
    llm, ref = LLM(path), mlx_k3.load(path)
    moe = llm.model.layers[1].mlp
    assert moe.w13.dtype == moe.w13_scale.dtype == torch.uint8  # held as shipped
    assert moe.w13.shape[-1] * 2 == moe.w13_scale.shape[-1] * 32 == llm.config.hidden_size // 2
    prompts = [clear_prompt(llm, n, seed=n, continuation=8) for n in (7, 30, 61)]
    matches_mlx(llm, ref, prompts)
