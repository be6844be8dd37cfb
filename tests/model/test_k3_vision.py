"""K3's vision tower, merge and projector, and its image processor, against mlx-vlm 0.7.10's
`kimi_k3` on mlx's CPU backend: a tiny random tower in the released format (`make-checkpoint
--preset k3-tiny-vl`), images of several sizes, aspect ratios and modes."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from kdaserve.config import ModelConfig
from kdaserve.image_processor import image_prompt, process, resized_size
from kdaserve.kernels import registry
from kdaserve.kernels.native.vision import image_attention_ready
from kdaserve.models.vision import VisionModel

mx = pytest.importorskip("mlx.core")
kimi_k3 = pytest.importorskip("mlx_vlm.models.kimi_k3")


def images() -> list[Image.Image]:
    g = np.random.RandomState(0)
    rgba = g.randint(0, 256, (50, 100, 4), np.uint8)
    rgba[:, :30, 3] = 0  # transparent on the left
    return [Image.fromarray(g.randint(0, 256, (56, 84, 3), np.uint8)),  # fits the grid
            Image.fromarray(rgba, "RGBA"),  # padded to 112 x 56
            Image.fromarray(g.randint(0, 256, (130, 45, 3), np.uint8)),  # tall, padded
            Image.fromarray(g.randint(0, 256, (20, 20), np.uint8), "L")]  # one merged row


def mlx_vision(path: Path) -> Any:
    """mlx-vlm's model from the checkpoint's config.json, its tower and projector loaded
    strictly from the checkpoint's tensors (the language model is not needed here)."""
    from mlx_vlm.models.kimi_k3.vision import VisionModel as MlxVision

    cfg = json.loads((path / "config.json").read_text())
    mc = kimi_k3.ModelConfig.from_dict(cfg)
    mc.text_config = kimi_k3.TextConfig.from_dict(cfg["text_config"])
    mc.vision_config = kimi_k3.VisionConfig.from_dict(cfg["vision_config"])
    model = kimi_k3.Model(mc)
    w = MlxVision(mc.vision_config).sanitize(
        {k: v for k, v in mx.load(str(path / "model.safetensors")).items()
         if k.startswith(("vision_tower.", "mm_projector."))})
    for part in ("vision_tower", "mm_projector"):
        getattr(model, part).load_weights(
            [(k[len(part) + 1:], v) for k, v in w.items() if k.startswith(part + ".")],
            strict=True)
    return model


def test_processor_matches_mlx_vlm() -> None:
    """Pixels, grids and token counts equal the reference's, for small images of each
    kind and for large ones it shrinks (a side limit, the patch limit)."""
    ref = kimi_k3.ImageProcessor()
    big = [Image.new("RGB", (1920, 1080), (200, 30, 60)),
           Image.fromarray(np.random.RandomState(1).randint(0, 256, (100, 8000, 3), np.uint8))]
    for img in images() + big:
        ours = process(img)
        out = ref([img])
        assert list(ours.grid) == out["grid_thws"].tolist()[0]
        assert torch.equal(ours.pixels, torch.from_numpy(np.array(out["pixel_values"])))
        assert ours.num_tokens == ours.grid[1] * ours.grid[2] // 4
    assert resized_size(8000, 100) == (7168, 89)  # 512 patches a side at most
    assert process(big[0]).grid == (1, 78, 138)


def test_prompt_names_the_original_size() -> None:
    p = process(images()[1])
    assert p.size == (100, 50) and p.num_tokens == 8
    assert image_prompt(p) == ("<|media_begin|>image 100x50<|media_content|>"
                               + "<|media_pad|>" * 8 + "<|media_end|>")


def test_features_match_mlx_vlm(vl_ckpt: Path) -> None:
    """The projected rows of four images in one call equal mlx-vlm's tower and projector on
    its own processor's pixels, image by image."""
    config = ModelConfig.from_pretrained(vl_ckpt)
    assert config.vision is not None and config.vision.media_pad_id == 3840 + 21
    ours = VisionModel.load(config.vision, vl_ckpt, torch.float32, torch.device("cpu"))
    processed = [process(img) for img in images()]
    rows = ours(torch.cat([p.pixels for p in processed]), [p.grid for p in processed])
    assert rows.shape == (sum(p.num_tokens for p in processed), config.hidden_size)
    ref = mlx_vision(vl_ckpt)
    out = kimi_k3.ImageProcessor()(images())
    feats = ref.mm_projector(ref.vision_tower(out["pixel_values"].transpose(0, 2, 3, 1),
                                              grid_thws=out["grid_thws"]))
    want = torch.tensor(np.array(feats.astype(mx.float32)))
    assert (rows - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())


@pytest.mark.skipif(not image_attention_ready(),
                    reason="no BF16-dot image attention in this host's build")
def test_bf16_tower_on_the_native_attention(vl_ckpt: Path) -> None:
    """In bf16 the tower runs on the native kernels (tests/kernels/test_native_vision.py),
    and its rows are as close to the fp32 tower's as with torch's ops in bf16."""
    config = ModelConfig.from_pretrained(vl_ckpt)
    assert config.vision is not None
    cpu = torch.device("cpu")
    processed = [process(img) for img in images()]
    pixels, grids = torch.cat([p.pixels for p in processed]), [p.grid for p in processed]
    want = VisionModel.load(config.vision, vl_ckpt, torch.float32, cpu)(pixels, grids)
    errors = {}
    for backend in ("native", "ref"):
        model = VisionModel.load(config.vision, vl_ckpt, torch.bfloat16, cpu, backend)
        assert model.vision_tower.encoder.blocks[0].ops.image_attention is registry.resolve(
            "image_attention", cpu, backend)
        errors[backend] = float((model(pixels, grids).float() - want).abs().mean())
    assert errors["native"] <= 1.1 * errors["ref"] + 1e-6, errors
    assert errors["native"] < 0.02 * float(want.abs().mean()), errors


def test_a_broken_tower_is_refused(vl_ckpt: Path, tmp_path: Path) -> None:
    """A missing or mis-shaped vision tensor is named at load."""
    from safetensors.torch import load_file, save_file

    config = ModelConfig.from_pretrained(vl_ckpt)
    assert config.vision is not None
    tensors = load_file(str(vl_ckpt / "model.safetensors"))
    (tmp_path / "config.json").write_text((vl_ckpt / "config.json").read_text())
    name = "vision_tower.encoder.blocks.1.wo.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="misses 1 tensors"):
        VisionModel.load(config.vision, tmp_path, torch.float32, torch.device("cpu"))
    save_file({**tensors, name: tensors[name][:, :-1].contiguous()},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="wo.weight' has shape"):
        VisionModel.load(config.vision, tmp_path, torch.float32, torch.device("cpu"))


def mlx_greedy(model: Any, ids: list[int], imgs: list[Image.Image], n: int) -> list[int]:
    """mlx-vlm's cached greedy decode of a prompt whose pads take its images' rows."""
    out = kimi_k3.ImageProcessor()(imgs)
    cache = model.make_cache()
    logits = model(mx.array([ids]), out["pixel_values"], cache=cache,
                   grid_thws=out["grid_thws"])
    toks: list[int] = []
    for _ in range(n):
        toks.append(int(mx.argmax(getattr(logits, "logits", logits)[0, -1]).item()))
        logits = model.language_model(mx.array([toks[-1:]]), cache=cache)
    return toks


@pytest.fixture(scope="module")
def vl_llm(vl_ckpt: Path) -> Any:
    from kdaserve import LLM

    return LLM(vl_ckpt, max_num_batched_tokens=32)  # prefill chunks end inside images


def test_greedy_tokens_with_images_match_mlx_vlm(vl_ckpt: Path, vl_llm: Any) -> None:
    """Three prompts with one, two and no images, generated together in chunks of 32 tokens
    (chunks start and end inside images), against mlx-vlm's model, each alone."""
    from mlx_vlm.utils import load_model

    from kdaserve import SamplingParams

    ims = images()
    prompts = ["Look:<|media_pad|> what is it?", "A<|media_pad|>and<|media_pad|>differ.",
               "No image here, just text."]
    data = [[ims[0]], [ims[1], ims[2]], []]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = vl_llm.generate(prompts, params, image_data=data)
    ref = load_model(vl_ckpt)
    for text, imgs, out in zip(prompts, data, outs, strict=True):
        ids = vl_llm.engine.encode(text)
        if imgs:
            ids = vl_llm.engine.images.expand(ids, imgs)[0]
            want = mlx_greedy(ref, ids, imgs, 8)
        else:
            want = mlx_greedy_text(ref, ids, 8)
        assert out.token_ids == want, text
    vl_llm.check_integrity()


def mlx_greedy_text(model: Any, ids: list[int], n: int) -> list[int]:
    cache = model.make_cache()
    logits = model.language_model(mx.array([ids]), cache=cache)
    toks: list[int] = []
    for _ in range(n):
        toks.append(int(mx.argmax(getattr(logits, "logits", logits)[0, -1]).item()))
        logits = model.language_model(mx.array([toks[-1:]]), cache=cache)
    return toks


def test_prefix_cache_tells_images_apart(vl_llm: Any) -> None:
    """A second turn about the same image hits the cache past the image and decodes the same;
    a different image of the same size never hits past its first pad."""
    from kdaserve import SamplingParams

    g = np.random.RandomState(7)
    a, b = (Image.fromarray(g.randint(0, 256, (56, 84, 3), np.uint8)) for _ in range(2))
    text = "Here:<|media_pad|>" + " and a long question after the image" * 20
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = vl_llm.generate([text], params, image_data=[[a]])[0]
    cache = vl_llm.engine.cache
    before = cache.hit_tokens
    again = vl_llm.generate([text], params, image_data=[[a]])[0]
    ids = vl_llm.engine.images.expand(vl_llm.engine.encode(text), [a])
    end_of_image = int(ids[1].pad_positions[-1]) + 1
    assert again.token_ids == first.token_ids
    assert cache.hit_tokens - before >= end_of_image
    before = cache.hit_tokens
    other = vl_llm.generate([text], params, image_data=[[b]])[0]
    assert cache.hit_tokens - before <= int(ids[1].pad_positions[0])
    assert len(other.token_ids) == 6
    vl_llm.check_integrity()


def test_tower_calls_are_bounded() -> None:
    """Images share a tower call up to CALL_PATCHES patches; one larger goes alone; with
    per_image each goes alone."""
    from kdaserve.models.vision import CALL_PATCHES, tower_calls

    big, small = (1, 258, 258), (1, 32, 32)  # 66,564 and 1,024 patches
    assert tower_calls([small] * 16) == [(0, 16)]
    assert tower_calls([small] * 17) == [(0, 16), (16, 17)]
    assert tower_calls([small, big, small]) == [(0, 1), (1, 2), (2, 3)]
    assert tower_calls([small] * 3, per_image=True) == [(0, 1), (1, 2), (2, 3)]
    assert tower_calls([]) == []
    assert CALL_PATCHES == 16 * 1024


def test_rows_are_dropped_once_every_sibling_passed_the_images(vl_llm: Any) -> None:
    """n = 2 siblings share one tower call; the rows go once both ran past the last pad,
    and both decode the same greedy tokens."""
    from kdaserve import SamplingParams

    engine = vl_llm.engine
    ids, inputs = engine.images.expand(engine.encode("Two<|media_pad|> and more text."),
                                       images()[:1])
    tower = engine.vision
    calls: list[int] = []
    forward = tower.forward
    tower.forward = lambda pixels, grids: calls.append(len(grids)) or forward(pixels, grids)
    try:
        rid = engine.add_request(ids, SamplingParams(n=2, temperature=0.0, max_tokens=4,
                                                     ignore_eos=True), images=inputs)
        outs = []
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.rid == rid and o.finished]
    finally:
        del tower.forward
    assert calls == [1] and inputs.rows is None and inputs.pending <= 0
    assert outs[0].outputs[0].token_ids == outs[0].outputs[1].token_ids
    vl_llm.check_integrity()


def test_deterministic_inference_with_images(vl_ckpt: Path) -> None:
    """Under deterministic inference each image takes a tower call of its own: an image
    request's tokens and logprobs are bit-identical alone and beside other image requests
    (whose images would otherwise share its GEMMs), and chunked."""
    from kdaserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    ims = images()
    prompts = ["A<|media_pad|>and<|media_pad|>differ.", "See<|media_pad|>", "Look<|media_pad|>"]
    data = [[ims[1], ims[2]], [ims[0]], [ims[3]]]

    def run(llm: LLM, batch: list[int]) -> tuple:
        outs = llm.generate([prompts[i] for i in batch], params,
                            image_data=[data[i] for i in batch])
        out = outs[batch.index(0)].outputs[0]
        return out.token_ids, out.logprobs, out.cumulative_logprob

    det = LLM(vl_ckpt, enable_deterministic_inference=True)
    alone = run(det, [0])
    tower = det.engine.vision
    assert tower is not None
    calls: list[int] = []
    forward = tower.forward
    tower.forward = lambda pixels, grids: calls.append(len(grids)) or forward(pixels, grids)
    assert run(det, [1, 0, 2]) == alone
    assert calls == [1, 1, 1, 1]  # a call per image (here the bits agree either way)
    chunked = LLM(vl_ckpt, enable_deterministic_inference=True, max_num_batched_tokens=16)
    assert run(chunked, [2, 0]) == alone
    det.check_integrity()


def test_bad_image_requests_are_refused(vl_llm: Any, vl_ckpt: Path) -> None:
    """More or fewer images than markers, images for a server of the text model alone: a
    ValueError naming why, nothing queued."""
    from kdaserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="marks 1 images .* 2 were given"):
        vl_llm.generate(["x<|media_pad|>"], params, image_data=[images()[:2]])
    with pytest.raises(ValueError, match="marks 0 images"):
        vl_llm.generate(["no marker"], params, image_data=[images()[:1]])
    with pytest.raises(ValueError, match="marks 1 images .* 0 were given"):  # a bare marker
        vl_llm.generate(["ok", "x<|media_pad|>"], params)
    assert not vl_llm.engine.has_unfinished()
    vl_llm.check_integrity()
    text_only = LLM(vl_ckpt, language_model_only=True)
    with pytest.raises(ValueError, match="--language-model-only"):
        text_only.generate(["x<|media_pad|>"], params, image_data=[images()[:1]])


KIMI = Path(__file__).resolve().parents[3] / "shared" / "kimi" / "tokenizer"


@pytest.mark.skipif(not (KIMI / "tiktoken.model").is_file(),
                    reason="needs ../shared/kimi (the real Kimi tokenizer)")
def test_image_prompts_match_mlx_vlm_on_the_real_tokenizer() -> None:
    """With Kimi's own tokenizer and K3's ids, a prompt's images expand to the ids mlx-vlm's
    KimiK3Processor gives (its placeholder where ours has the one-pad marker)."""
    from mlx_vlm.models.kimi_k3.processing_kimi_k3 import (
        KimiK3Processor,
        _convert_kimi_k3_tiktoken,
    )

    from kdaserve.multimodal import expand
    from kdaserve.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(KIMI)
    pad = tok.token_to_id("<|media_pad|>")
    assert pad == 163605
    ims = images()[:3]
    ours, inputs = expand(tok.encode("Compare<|media_pad|>with<|media_pad|>and<|media_pad|>."),
                          ims, pad, tok.encode)
    ref = KimiK3Processor(image_processor=kimi_k3.ImageProcessor(),
                          tokenizer=_convert_kimi_k3_tiktoken(
                              str(KIMI / "tiktoken.model"), str(KIMI / "tokenizer_config.json")))
    out = ref(images=ims, text="Compare<|kimi_image_placeholder|>with"
                               "<|kimi_image_placeholder|>and<|kimi_image_placeholder|>.")
    assert ours == np.array(out["input_ids"])[0].tolist()
    assert inputs.pad_positions.tolist() == [i for i, t in enumerate(ours) if t == pad]


def alpha_images() -> list[Image.Image]:
    """Images with transparency of each kind: RGBA with graded alpha, LA, palette with a
    transparent index, and an RGB one (no alpha)."""
    g = np.random.RandomState(5)
    rgba = g.randint(0, 256, (70, 90, 4), np.uint8)
    rgba[..., 3] = np.linspace(0, 255, 90, dtype=np.uint8)[None, :]
    la = np.stack([g.randint(0, 256, (40, 30), np.uint8),
                   g.randint(0, 256, (40, 30), np.uint8)], -1)
    pal = Image.fromarray(g.randint(0, 256, (30, 50, 3), np.uint8)).convert("P")
    pal.info["transparency"] = 3
    return [Image.fromarray(rgba, "RGBA"), Image.fromarray(la, "LA"), pal,
            Image.fromarray(g.randint(0, 256, (28, 28, 3), np.uint8))]


@pytest.mark.parametrize(("background", "stage"), [
    ({"pattern": "chessboard", "chessboard_square_size": 4}, "before_resize"),
    ({"pattern": "chessboard", "chessboard_square_on_top_left": False,
      "chessboard_gray_value": 90}, "after_resize"),
    ({"pattern": "white"}, "after_resize"),
    ({"pattern": "gray"}, "before_resize"),
    (None, "before_resize"),
])
def test_transparent_pixels_filled_as_mlx_vlm(background: Any, stage: str) -> None:
    """With the checkpoint's transparent_bg_config, each kind of transparent image's patches
    equal mlx-vlm's processor's with the same config, before or after the resize."""
    from kdaserve.image_processor import ProcessorConfig

    config = ProcessorConfig.from_dict({"transparent_bg_config": background,
                                        "transparent_bg_fill_stage": stage})
    ref = kimi_k3.ImageProcessor(transparent_bg_config=background,
                                 transparent_bg_fill_stage=stage)
    big = Image.fromarray(np.random.RandomState(6).randint(0, 256, (600, 900, 4), np.uint8))
    for img in [*alpha_images(), big]:  # the big one is resized
        out = ref([img])
        assert torch.equal(process(img, config).pixels,
                           torch.from_numpy(np.array(out["pixel_values"]))), img.mode


def test_the_checkpoints_processor_config_is_used(vl_ckpt: Path, tmp_path: Path) -> None:
    """preprocessor_config.json's media_proc_cfg reaches the engine's and the server's image
    processing; a value K3's processor does not have is refused by name."""
    import shutil

    from kdaserve import LLM
    from kdaserve.image_processor import ProcessorConfig
    from kdaserve.server.media import MediaLimits, MediaLoader

    ckpt = tmp_path / "vl"
    shutil.copytree(vl_ckpt, ckpt)
    cfg = {"transparent_bg_config": {"pattern": "white"}, "patch_size": 14,
           "merge_kernel_size": 2, "image_mean": [0.5, 0.5, 0.5]}
    (ckpt / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": cfg}))
    want = process(alpha_images()[0], ProcessorConfig.from_dict(cfg))
    assert not torch.equal(want.values, process(alpha_images()[0]).values)
    engine = LLM(ckpt).engine
    _, inputs = engine.images.expand(engine.encode("x<|media_pad|>"), alpha_images()[:1])
    assert inputs is not None and torch.equal(inputs.images[0].values, want.values)
    assert engine.images.info["image_processor"] == ProcessorConfig.from_dict(cfg)
    buf = io.BytesIO()
    alpha_images()[0].save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    loader = MediaLoader(MediaLimits(), engine.images.pad_id, None, engine.tokenizer.encode,
                         engine.images.info["image_processor"])
    _, served = loader.prepare(engine.encode("x<|media_pad|>"), [("image", url)])
    assert served is not None and torch.equal(served.images[0].values, want.values)
    (ckpt / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": {
        "patch_size": 16}}))
    with pytest.raises(ValueError, match="media_proc_cfg.patch_size=16"):
        LLM(ckpt)
