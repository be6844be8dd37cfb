"""Images in a request (K3, k3_spec.md 8): the prompt's image markers expanded, the places of
the tower's rows, and the prefix-cache key that tells images apart.

A prompt marks each image with one `<|media_pad|>` (what SGLang's K3 chat template emits);
`expand` replaces the i-th marker with image i's prompt (`<|media_begin|>image WxH
<|media_content|>`, one pad per row the tower gives it, `<|media_end|>`). The rows are
computed once per request, when its first chunk reaches a pad, and each chunk takes the rows
of the pads it runs (`rows_for`), so a chunk may start or end inside an image.

The pads of two images of the same size are the same token ids, so the prefix cache keys a
request by `key_ids`: its tokens with each image's pads replaced by an id derived from the
image's content (negative: no token has it). A second turn about the same image hits; a
different image never does."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from PIL import Image

from kdaserve.image_processor import (
    DEFAULT,
    ProcessedImage,
    ProcessorConfig,
    image_prompt,
    process,
)


@dataclass(eq=False)
class ImageInputs:
    images: list[ProcessedImage]
    pad_positions: torch.Tensor  # [num_pads] prompt positions of the pads, image by image
    prompt_key: list[int]  # the prompt, each image's pads replaced by its content key
    rows: torch.Tensor | None = None  # [num_pads, D] the projected rows, once computed
    # requests (the n siblings) still to run past the last pad: the rows are dropped when
    # none is (one preempted and run again computes them again)
    pending: int = 1

    @property
    def pixels(self) -> torch.Tensor:
        return torch.cat([im.pixels for im in self.images])

    @property
    def grids(self) -> list[tuple[int, int, int]]:
        return [im.grid for im in self.images]

    def rows_for(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pads among prompt positions [start, end): (their offsets from start, rows)."""
        assert self.rows is not None, "the image rows are computed before the chunk runs"
        lo = int(torch.searchsorted(self.pad_positions, start))
        hi = int(torch.searchsorted(self.pad_positions, end))
        return self.pad_positions[lo:hi] - start, self.rows[lo:hi]

    def key_ids(self, ids: list[int]) -> list[int]:
        """ids (the prompt, then outputs, which hold no pads) with the pads keyed."""
        return self.prompt_key + ids[len(self.prompt_key):]


def content_key(image: ProcessedImage) -> int:
    """A negative id from the image's pixels and grid (64 bits of SHA-256)."""
    h = hashlib.sha256(repr(image.grid).encode())
    h.update(image.values.numpy().tobytes())
    return -1 - int.from_bytes(h.digest()[:8], "little") % (2 ** 62)


def expand(ids: list[int], images: list[Image.Image], pad_id: int,
           encode: Callable[[str], list[int]], processor: ProcessorConfig = DEFAULT,
           ) -> tuple[list[int], ImageInputs]:
    """The prompt with image i's prompt in place of its i-th `<|media_pad|>` marker."""
    check_markers(ids, len(images), pad_id)
    return expand_processed(ids, [process(img, processor) for img in images], pad_id, encode)


def check_markers(ids: list[int], images: int, pad_id: int) -> None:
    markers = ids.count(pad_id)
    if markers != images:
        raise ValueError(f"the prompt marks {markers} images (one <|media_pad|> each) but "
                         f"{images} were given")


def expand_processed(ids: list[int], processed: list[ProcessedImage], pad_id: int,
                     encode: Callable[[str], list[int]]) -> tuple[list[int], ImageInputs]:
    """As `expand`, the images processed already."""
    check_markers(ids, len(processed), pad_id)
    markers = [i for i, t in enumerate(ids) if t == pad_id]
    out: list[int] = []
    pads: list[int] = []
    prev = 0
    for at, im in zip(markers, processed, strict=True):
        out.extend(ids[prev:at])
        part = encode(image_prompt(im))
        pads.extend(len(out) + j for j, t in enumerate(part) if t == pad_id)
        out.extend(part)
        prev = at + 1
    out.extend(ids[prev:])
    if len(pads) != sum(im.num_tokens for im in processed):  # the tokenizer's specials
        raise ValueError("the tokenizer does not encode <|media_pad|> as the config's "
                         f"media_placeholder_token_id {pad_id}")
    key = list(out)
    at = 0
    for im in processed:
        k = content_key(im)
        for p in pads[at:at + im.num_tokens]:
            key[p] = k
        at += im.num_tokens
    return out, ImageInputs(processed, torch.tensor(pads, dtype=torch.int64), key)
