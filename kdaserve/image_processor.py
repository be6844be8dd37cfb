"""K3's image processor: a decoded image to the vision tower's patches, and its prompt.

As mlx-vlm 0.7.10's `KimiK3ImageProcessor` (and SGLang's `navit_resize_config`) do it:
- the scale is min(1, sqrt(65,536 / patches), 512 * 14 / w, 512 * 14 / h) (never up), the new
  size int(side * scale), at least 1 and at most 7,168; resized with PIL's bicubic filter;
- padded right and bottom with black to multiples of 28 (2 x 2 patches of 14), so the grid
  merges evenly (the patch limit is checked before padding, so a 5000 x 5000 image gives
  258 x 258 = 66,564 patches: as the reference does);
- RGB from any mode (an alpha channel dropped: the reference's default without a
  `transparent_bg_config`), scaled to [-1, 1] (mean and std 0.5);
- cut into 14 x 14 patches, row-major, each flattened (channel, row, column).
An image of gh x gw patches becomes gh * gw / 4 rows after the tower's 2 x 2 merge, one per
`<|media_pad|>` in its prompt: `<|media_begin|>image {W}x{H}<|media_content|>`, the pads,
`<|media_end|>`, with W x H the original size."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

PATCH = 14
MERGE = 2
IN_PATCH_LIMIT = 65536
SIDE_LIMIT = 512  # patches a side
MEAN = STD = 0.5


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


def process(image: Image.Image) -> ProcessedImage:
    size = image.size
    rgb = image.convert("RGB")
    new = resized_size(*size)
    if new != size:
        rgb = rgb.resize(new, Image.Resampling.BICUBIC)
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
