"""K3's vision tower, merge and projector, and its image processor, against mlx-vlm 0.7.10's
`kimi_k3` on mlx's CPU backend: a tiny random tower in the released format (`make-checkpoint
--preset k3-tiny-vl`), images of several sizes, aspect ratios and modes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from kdaserve.checkpoint import make_checkpoint
from kdaserve.config import ModelConfig
from kdaserve.image_processor import image_prompt, process, resized_size
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


@pytest.fixture(scope="module")
def vl_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("vl") / "k3-tiny-vl", "k3-tiny-vl",
                           seed=0, dtype="float32")


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
