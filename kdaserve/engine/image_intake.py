"""Which prompts with images an engine takes: the refusal it gives for images (decided once at
build), the expansion of a prompt's markers (`multimodal.expand`, for callers in-process) and
the check of an expanded prompt's `ImageInputs` (what a server sends, processed already)."""

from __future__ import annotations

from PIL import Image

from kdaserve.image_processor import DEFAULT, ProcessorConfig
from kdaserve.multimodal import ImageInputs, expand
from kdaserve.tokenizer import Tokenizer


class ImageIntake:
    def __init__(self, pad_id: int | None, tokenizer: Tokenizer | None,
                 refusal: str | None, processor: ProcessorConfig = DEFAULT) -> None:
        self.pad_id = pad_id  # `<|media_pad|>`, which marks an image (None: no tower)
        self.tokenizer = tokenizer
        self.refusal = refusal  # why images are refused (None: they are taken)
        self.processor = processor  # the checkpoint's preprocessor_config.json

    @property
    def info(self) -> dict[str, object]:
        """What a server needs to prepare images for this engine."""
        return {"media_pad_id": self.pad_id, "image_refusal": self.refusal,
                "image_processor": self.processor}

    def expand(self, ids: list[int], images: list[Image.Image],
               ) -> tuple[list[int], ImageInputs | None]:
        """The prompt with each image's prompt at its marker, and where its rows go; a prompt
        with markers needs as many images (None: no images, no markers)."""
        if not images and (self.pad_id is None or self.pad_id not in ids):
            return ids, None
        if self.refusal is not None:
            raise ValueError(self.refusal)
        assert self.pad_id is not None and self.tokenizer is not None
        return expand(ids, images, self.pad_id, self.tokenizer.encode, self.processor)

    def check(self, ids: list[int], images: ImageInputs | None) -> None:
        """An expanded prompt's images: each pad has its row, and no marker goes without."""
        pad = self.pad_id
        if images is None:
            if pad is not None and pad in ids:
                raise ValueError(f"the prompt marks {ids.count(pad)} images (one "
                                 "<|media_pad|> each) but 0 were given")
            return
        if self.refusal is not None:
            raise ValueError(self.refusal)
        positions = images.pad_positions.tolist()
        if (len(images.prompt_key) != len(ids) or ids.count(pad) != len(positions)
                or any(ids[p] != pad for p in positions)
                or len(positions) != sum(im.num_tokens for im in images.images)):
            raise ValueError("the images' pads do not match the prompt's <|media_pad|> tokens")
