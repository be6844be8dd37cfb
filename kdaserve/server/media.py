"""Images from requests (K3's vision tower): where each comes from (a `data:` URL, an http(s)
URL on a host `--allowed-media-domains` names, or for /generate SGLang's bare base64), decoded
with Pillow within limits, processed as K3's processor does and put in the prompt at its
markers (`multimodal.expand`). The server does this, off its event loop, so a large image never
holds up the engine's steps; the engine gets the processed pixels (`ImageInputs`).

Every problem is a `ValueError` (HTTP 400) naming the image and, where one was passed, the
limit: a request with a broken image is refused whole, before anything is queued."""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes, urlsplit

import httpx
from PIL import Image

from kdaserve.image_processor import DEFAULT, ProcessedImage, ProcessorConfig, num_tokens, process
from kdaserve.multimodal import ImageInputs, check_markers, expand_processed

# what Pillow may decode: the web's image formats (not its many exotic plug-ins)
FORMATS = ("PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP")  # MPO: many cameras' JPEGs
# requests with images are prepared on threads of their own: a slow image host then holds
# these, never the threads that tokenize every other request
WORKERS = 4


@dataclass(frozen=True)
class MediaLimits:
    """What one request's images may take (flags of `kdaserve serve`)."""

    max_images: int = 16  # per request: --limit-mm-per-prompt '{"image": N}' (vLLM's flag)
    max_image_pixels: int = 4096 * 4096  # one decoded image: --max-image-pixels
    max_image_tokens: int | None = None  # all of a request's image pads: --max-image-tokens
    max_image_bytes: int = 20 << 20  # one image file: --max-image-bytes
    fetch_timeout: float = 10.0  # seconds to fetch one http(s) image: --media-fetch-timeout
    allowed_domains: tuple[str, ...] = ()  # hosts http(s) images may come from


def parse_mm_limit(raw: str | None) -> int | None:
    """vLLM's `--limit-mm-per-prompt '{"image": N}'` (images only: K3 takes no other media)."""
    if raw is None:
        return None
    try:
        limits = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"--limit-mm-per-prompt must be JSON like '{{\"image\": 4}}': "
                         f"{e}") from None
    if not isinstance(limits, dict) or set(limits) - {"image"} or \
            not isinstance(limits.get("image", 0), int) or limits.get("image", 0) < 0:
        raise ValueError("--limit-mm-per-prompt takes only a count of images, like "
                         "'{\"image\": 4}' (this model reads no other media)")
    return limits.get("image")


class MediaLoader:
    def __init__(self, limits: MediaLimits, pad_id: int | None, refusal: str | None,
                 encode: Callable[[str], list[int]], processor: ProcessorConfig = DEFAULT,
                 ) -> None:
        self.limits = limits
        self.pad_id = pad_id  # the engine's <|media_pad|> (None: it has no vision tower)
        self.refusal = refusal  # why the engine takes no images (None: it takes them)
        self.encode = encode  # the tokenizer's, special tokens allowed (the image prompts)
        self.processor = processor  # the checkpoint's preprocessor_config.json
        self.executor = ThreadPoolExecutor(WORKERS, thread_name_prefix="media")

    def prepare(self, ids: list[int], sources: list[tuple[str, str]],
                bare_base64: bool = False, room: int | None = None,
                ) -> tuple[list[int], ImageInputs | None]:
        """The prompt with each image's prompt at its marker. `sources`: (where the image is
        in the request, its URL), in prompt order; `bare_base64`: a source that is no URL is
        the file's base64 (SGLang's /generate); `room`: the tokens the prompt may take.
        Each image's tokens are counted from its header, before its pixels are decoded."""
        if not sources:
            return ids, None
        if self.refusal is not None:
            raise ValueError(self.refusal)
        assert self.pad_id is not None
        lim = self.limits
        if len(sources) > lim.max_images:
            raise ValueError(f"{len(sources)} images in one request; the server takes at most "
                             f"{lim.max_images} (--limit-mm-per-prompt)")
        check_markers(ids, len(sources), self.pad_id)
        processed: list[ProcessedImage] = []
        tokens = 0
        for where, url in sources:
            image = self.open(url, where, bare_base64)
            tokens += num_tokens(*image.size)
            if lim.max_image_tokens is not None and tokens > lim.max_image_tokens:
                raise ValueError(f"the request's images take over {lim.max_image_tokens} "
                                 "tokens (--max-image-tokens)")
            if room is not None and len(ids) + tokens > room:
                raise ValueError(f"the request's images take {tokens} tokens or more; with "
                                 f"its text that is over the {room} tokens of the context")
            processed.append(process(self.decoded(image, where), self.processor))
        return expand_processed(ids, processed, self.pad_id, self.encode)

    def open(self, url: str, where: str, bare_base64: bool = False) -> Image.Image:
        """One image's file, its header read and checked: nothing decoded yet."""
        if not isinstance(url, str) or not url:
            raise ValueError(f"{where}: an image must be given as a URL string")
        if url.startswith("data:"):
            data = self._data_url(url, where)
        elif url.startswith(("http://", "https://")):
            data = self._fetch(url, where)
        elif bare_base64:
            data = self._base64(url, where)
        else:
            raise ValueError(f"{where}: an image URL must be a data: URL or an http(s) URL, got "
                             f"{url[:40]!r}")
        return self.header(data, where)

    def header(self, data: bytes, where: str) -> Image.Image:
        lim = self.limits
        try:
            image = Image.open(io.BytesIO(data), formats=FORMATS)
        except Image.DecompressionBombError:
            raise ValueError(f"{where}: the image has more than {lim.max_image_pixels} pixels "
                             "(--max-image-pixels)") from None
        except Exception as e:  # noqa: BLE001 - Pillow raises many kinds for bad input
            raise ValueError(f"{where}: not an image in a supported format "
                             f"({', '.join(FORMATS)}): {e}") from None
        w, h = image.size
        if w * h > lim.max_image_pixels:  # read from the header: nothing decoded yet
            raise ValueError(f"{where}: the image is {w}x{h} = {w * h} pixels; the server takes "
                             f"at most {lim.max_image_pixels} (--max-image-pixels)")
        return image

    @staticmethod
    def decoded(image: Image.Image, where: str) -> Image.Image:
        """The image decoded whole (a truncated file fails here, not in the engine)."""
        try:
            image.load()
        except Exception as e:  # noqa: BLE001 - truncated or corrupt data
            raise ValueError(f"{where}: the {image.format} image could not be decoded: "
                             f"{e}") from None
        return image

    def _data_url(self, url: str, where: str) -> bytes:
        head, sep, payload = url[5:].partition(",")
        if not sep:
            raise ValueError(f"{where}: a data: URL needs a comma before its data")
        params = head.split(";")
        media_type = params[0].strip().lower()
        if not media_type.startswith("image/"):
            raise ValueError(f"{where}: the data: URL's type is {media_type or 'text/plain'!r}, "
                             "not an image type")
        if "base64" in params[1:]:
            return self._base64(payload, where)
        data = unquote_to_bytes(payload)
        self._check_bytes(len(data), where)
        return data

    def _base64(self, payload: str, where: str) -> bytes:
        self._check_bytes(len(payload) * 3 // 4, where)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{where}: the image's base64 data is malformed") from None

    def _check_bytes(self, size: int, where: str) -> None:
        if size > self.limits.max_image_bytes:
            raise ValueError(f"{where}: the image file is over {self.limits.max_image_bytes} "
                             "bytes (--max-image-bytes)")

    def _fetch(self, url: str, where: str) -> bytes:
        lim = self.limits
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 - a malformed port raises here, not in the client
        except ValueError as e:
            raise ValueError(f"{where}: malformed image URL: {e}") from None
        host = (parts.hostname or "").rstrip(".").lower()
        if host not in lim.allowed_domains:
            allowed = ", ".join(lim.allowed_domains) or "none"
            raise ValueError(f"{where}: images from host {host!r} are not allowed "
                             f"(--allowed-media-domains: {allowed})")
        try:
            # one deadline for the whole fetch, headers included: httpx's timeouts are per
            # read, so a host sending its headers a byte at a time would hold this thread
            return asyncio.run(asyncio.wait_for(self._get(url, where), lim.fetch_timeout))
        except (TimeoutError, httpx.TimeoutException):
            raise ValueError(f"{where}: fetching the image took over {lim.fetch_timeout:g} s "
                             "(--media-fetch-timeout)") from None
        except (httpx.HTTPError, httpx.InvalidURL) as e:
            raise ValueError(f"{where}: the image could not be fetched: {e}") from None

    async def _get(self, url: str, where: str) -> bytes:
        # no redirects: one could lead to a host outside the allow-list
        async with httpx.AsyncClient(timeout=self.limits.fetch_timeout,
                                     follow_redirects=False) as client, \
                client.stream("GET", url) as r:
            if r.status_code != 200:
                raise ValueError(f"{where}: fetching the image gave HTTP {r.status_code}")
            kind = r.headers.get("content-type", "").split(";")[0].strip().lower()
            if not kind.startswith("image/"):
                raise ValueError(f"{where}: the URL's content type is {kind or 'none'!r}, "
                                 "not an image type")
            data = bytearray()
            async for chunk in r.aiter_bytes():
                data += chunk
                self._check_bytes(len(data), where)
            return bytes(data)
