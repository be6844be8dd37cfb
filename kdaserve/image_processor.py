"""K3's image processor: a decoded image to the vision tower's patches, and its prompt.

As mlx-vlm 0.7.10's `KimiK3ImageProcessor` (and SGLang's `navit_resize_config`) do it:
- the scale is min(1, sqrt(65,536 / patches), 512 * 14 / w, 512 * 14 / h) (never up), the new
  size int(side * scale), at least 1 and at most 7,168; resized with PIL's bicubic filter;
- padded right and bottom with black to multiples of 28 (2 x 2 patches of 14), so the grid
  merges evenly (the patch limit is checked before padding, so a 5000 x 5000 image gives
  258 x 258 = 66,564 patches: as the reference does);
- RGB from any mode: transparent pixels filled over the background the checkpoint's
  `preprocessor_config.json` names (`media_proc_cfg.transparent_bg_config`: black, white, gray
  or a chessboard; before or after the resize), the alpha channel dropped without one; scaled
  to [-1, 1] (mean and std 0.5);
- cut into 14 x 14 patches, row-major, each flattened (channel, row, column).
An image of gh x gw patches becomes gh * gw / 4 rows after the tower's 2 x 2 merge, one per
`<|media_pad|>` in its prompt: `<|media_begin|>image {W}x{H}<|media_content|>`, the pads,
`<|media_end|>`, with W x H the original size."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

PATCH = 14
MERGE = 2
IN_PATCH_LIMIT = 65536
SIDE_LIMIT = 512  # patches a side
MEAN = STD = 0.5
# what the processor's config may state, only with these values (the tower is built for them)
FIXED = {"patch_size": PATCH, "in_patch_limit": IN_PATCH_LIMIT,
         "patch_limit_on_one_side": SIDE_LIMIT, "image_mean": [MEAN] * 3, "image_std": [STD] * 3,
         "merge_kernel_size": [MERGE, MERGE]}
PATTERNS = ("black", "white", "gray", "chessboard")
FILL_STAGES = ("before_resize", "after_resize")


@dataclass(frozen=True)
class ProcessorConfig:
    """`preprocessor_config.json`'s `media_proc_cfg` (K3's defaults where the file or a key is
    absent): how transparent pixels are filled. Any other key K3's processor reads must have
    K3's value (refused by name otherwise)."""

    background: dict[str, Any] | None = field(default=None, hash=False)  # transparent_bg_config
    fill_stage: str = "before_resize"

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ProcessorConfig:
        file = Path(path) / "preprocessor_config.json"
        if not file.is_file():
            return cls()
        raw = json.loads(file.read_text(encoding="utf-8"))
        return cls.from_dict(raw.get("media_proc_cfg", {}) if isinstance(raw, dict) else {})

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ProcessorConfig:
        for key, want in FIXED.items():
            value = raw.get(key, want)
            if (list(value) if isinstance(value, list | tuple) else value) != want and not (
                    key == "merge_kernel_size" and value == MERGE):
                raise ValueError(f"media_proc_cfg.{key}={value!r} is not K3's processor's "
                                 f"({want!r})")
        bg = raw.get("transparent_bg_config")
        if bg is not None and (not isinstance(bg, dict)
                               or bg.get("pattern", "black") not in PATTERNS):
            raise ValueError(f"media_proc_cfg.transparent_bg_config={bg!r}: its pattern must be "
                             f"one of {PATTERNS}")
        stage = raw.get("transparent_bg_fill_stage", "before_resize")
        if stage not in FILL_STAGES:
            raise ValueError(f"media_proc_cfg.transparent_bg_fill_stage={stage!r}: one of "
                             f"{FILL_STAGES}")
        return cls(None if bg is None else dict(bg), stage)

    def fill(self, image: Image.Image) -> Image.Image:
        """RGB: transparent pixels over the background (alpha dropped without one)."""
        bg_cfg = self.background
        if bg_cfg is None or image.mode == "RGB":
            return image.convert("RGB")
        if "A" not in image.getbands() and "transparency" not in image.info:
            return image.convert("RGB")
        rgba = np.asarray(image.convert("RGBA"))
        h, w = rgba.shape[:2]
        pattern = bg_cfg.get("pattern", "black")
        if pattern == "chessboard":
            square = bg_cfg.get("chessboard_square_size", 16)
            light = bg_cfg.get("chessboard_white_value", 255)
            dark = bg_cfg.get("chessboard_gray_value", 200)
            odd = 1 if bg_cfg.get("chessboard_square_on_top_left", True) else 0
            ys, xs = np.arange(h)[:, None] // square, np.arange(w)[None, :] // square
            bg = np.where(((ys + xs) % 2 == odd)[..., None], dark, light).astype(np.uint8)
            bg = np.broadcast_to(bg, (h, w, 3))
        else:
            bg = np.full((h, w, 3), {"black": 0, "white": 255, "gray": 128}[pattern], np.uint8)
        alpha = rgba[:, :, 3:4].astype(np.float32) / 255.0
        return Image.fromarray((alpha * rgba[:, :, :3] + (1 - alpha) * bg).astype(np.uint8))


DEFAULT = ProcessorConfig()


@dataclass(frozen=True)
class ProcessedImage:
    # [gh * gw, 3, 14, 14] uint8, the resized and padded image's patches: a quarter of the
    # float32 pixels' bytes while a request waits (`pixels` scales them when the tower runs)
    values: torch.Tensor
    grid: tuple[int, int, int]  # (t, gh, gw) patches
    size: tuple[int, int]  # the original (W, H)

    @property
    def num_tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w // (MERGE * MERGE)

    @property
    def pixels(self) -> torch.Tensor:
        """[gh * gw, 3, 14, 14] float32 in [-1, 1], the tower's input."""
        return (self.values.float() / 255.0 - MEAN) / STD


def grid_of(w: int, h: int) -> tuple[int, int, int]:
    """The patch grid (t, gh, gw) an image of w x h pixels becomes."""
    nw, nh = resized_size(w, h)
    step = PATCH * MERGE
    return 1, -(-nh // step) * MERGE, -(-nw // step) * MERGE


def num_tokens(w: int, h: int) -> int:
    """The `<|media_pad|>`s of an image of w x h pixels (known before it is decoded)."""
    t, gh, gw = grid_of(w, h)
    return t * gh * gw // (MERGE * MERGE)


def resized_size(w: int, h: int) -> tuple[int, int]:
    """The size an image of w x h is resized to before padding."""
    patches = max(1, w // PATCH) * max(1, h // PATCH)
    scale = min(1.0, math.sqrt(IN_PATCH_LIMIT / patches), SIDE_LIMIT * PATCH / w,
                SIDE_LIMIT * PATCH / h)
    cap = SIDE_LIMIT * PATCH
    return min(max(1, int(w * scale)), cap), min(max(1, int(h * scale)), cap)


def process(image: Image.Image, config: ProcessorConfig = DEFAULT) -> ProcessedImage:
    size = image.size
    new = resized_size(*size)
    if config.background is None or config.fill_stage == "before_resize":
        rgb = config.fill(image)
    else:  # resized with its alpha, then filled
        rgb = image.convert("RGBA") if image.mode == "P" else image
    if new != size:
        rgb = rgb.resize(new, Image.Resampling.BICUBIC)
    rgb = config.fill(rgb)
    step = PATCH * MERGE
    padded = (-(-new[0] // step) * step, -(-new[1] // step) * step)
    if padded != new:
        canvas = Image.new("RGB", padded, (0, 0, 0))
        canvas.paste(rgb, (0, 0))
        rgb = canvas
    arr = np.asarray(rgb, dtype=np.uint8)  # [H, W, 3]
    gh, gw = padded[1] // PATCH, padded[0] // PATCH
    values = torch.from_numpy(arr.copy()).view(gh, PATCH, gw, PATCH, 3).permute(0, 2, 4, 1, 3)
    assert (1, gh, gw) == grid_of(*size)
    return ProcessedImage(values.reshape(gh * gw, 3, PATCH, PATCH).contiguous(), (1, gh, gw),
                          size)


def image_prompt(image: ProcessedImage) -> str:
    """The text an image stands for in the prompt (K3's special tokens by name)."""
    w, h = image.size
    return (f"<|media_begin|>image {w}x{h}<|media_content|>"
            + "<|media_pad|>" * image.num_tokens + "<|media_end|>")
