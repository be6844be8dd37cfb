"""Images through the HTTP API (K3's vision tower; server/media.py): chat `image_url` parts,
the Responses API's `input_image` and /generate's `image_data`, from data: URLs, bare base64
and http(s) URLs on an allowed host (a real HTTP server on 127.0.0.1 here), on a tiny random
`k3-tiny-vl` checkpoint.

The prompt the server builds equals Moonshot's renderer's with mlx-vlm's processor's image
prompts; its greedy tokens equal the in-process engine's for the same ids and images (which
tests/model/test_k3_vision.py holds to mlx-vlm's model); a second turn about the same image
hits the prefix cache and a different image does not; hostile images are 400s that name the
limit, beside a normal request that is not disturbed."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from kdaserve import LLM, SamplingParams
from kdaserve.tokenizer import Tokenizer
from tests.ports import free_port
from tests.server.conftest import ServerProc, is_idle, start_server, stop_server, wait_idle

pytest.importorskip("mlx_vlm.models.kimi_k3")

CHAT = "/v1/chat/completions"
MAX_IMAGE_TOKENS = 60
FETCH_TIMEOUT = 2.0
DRIP = 40.0  # seconds a host takes to send its headers, a byte at a time


def noise(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (h, w, 3), np.uint8))


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def decoded(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


# the images the good requests use: 24 and 4 pads (112 x 168 and 56 x 56 pixels)
PNG = encoded(noise(112, 168, 0))
JPEG = encoded(noise(56, 56, 1), "JPEG")
OTHER_PNG = encoded(noise(112, 168, 2))  # same size as PNG, other pixels


class MediaHost:
    """A plain HTTP server on 127.0.0.1: each path answers (status, content type, body)
    after a delay."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple[int, str, bytes, float]] = {}
        routes = self.routes

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path == "/drip.png":  # the headers a byte at a time, for DRIP s
                    head = (f"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n"
                            f"Content-Length: {len(PNG)}\r\n\r\n").encode()
                    try:
                        for byte in head:
                            self.wfile.write(bytes([byte]))
                            self.wfile.flush()
                            time.sleep(DRIP / len(head))
                        self.wfile.write(PNG)
                    except OSError:  # the server gave up on it
                        pass
                    return
                status, kind, body, delay = routes.get(self.path, (404, "text/plain", b"", 0))
                time.sleep(delay)
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                if status == 302:
                    self.send_header("Location", "http://localhost/a.png")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


@pytest.fixture(scope="module")
def host() -> Iterator[MediaHost]:
    h = MediaHost()
    h.routes.update({
        "/a.jpg": (200, "image/jpeg", JPEG, 0.0),
        "/page": (200, "text/html", b"<html>not an image</html>", 0.0),
        "/moved": (302, "text/plain", b"", 0.0),
        "/slow.png": (200, "image/png", PNG, FETCH_TIMEOUT + 1.5),
    })
    yield h
    h.server.shutdown()


@pytest.fixture(scope="module")
def vl_server(vl_ckpt: Path, host: MediaHost,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    s = start_server(vl_ckpt, tmp_path_factory.mktemp("vl-logs"),
                     "--allowed-media-domains", "127.0.0.1",
                     "--limit-mm-per-prompt", json.dumps({"image": 3}),
                     "--max-image-pixels", str(200 * 200), "--max-image-bytes", "120000",
                     "--max-image-tokens", str(MAX_IMAGE_TOKENS),
                     "--media-fetch-timeout", str(FETCH_TIMEOUT),
                     "--max-num-batched-tokens", "32")  # prefill chunks end inside images
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def http(vl_server: ServerProc) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=vl_server.url, timeout=120.0) as client:
        yield client


@pytest.fixture(scope="module")
def vl_llm(vl_ckpt: Path) -> LLM:
    return LLM(vl_ckpt)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def two_images(host: MediaHost) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [
        {"type": "text", "text": "What differs between "}, image_part(data_url(PNG)),
        {"type": "text", "text": " and "}, image_part(host.url("/a.jpg")),
        {"type": "text", "text": "?"}]}]


def test_generate_image_data_equals_the_engine(http: httpx.Client, vl_llm: LLM,
                                               host: MediaHost) -> None:
    """/generate with input_ids (markers as pad ids) and with text, images as a data: URL,
    an http URL and bare base64; one prompt and a batch with an image-less prompt."""
    tok = vl_llm.engine.tokenizer
    assert tok is not None
    text = "Look<|media_pad|>then<|media_pad|>: what?"
    ids = tok.encode(text)
    sources = [data_url(PNG), host.url("/a.jpg")]
    want = vl_llm.generate(prompt_token_ids=[ids], sampling_params=greedy(8),
                           image_data=[[decoded(PNG), decoded(JPEG)]])[0]
    sp = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = http.post("/generate", json={"input_ids": ids, "image_data": sources,
                                     "sampling_params": sp})
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == want.outputs[0].token_ids
    assert r.json()["meta_info"]["prompt_tokens"] == len(want.prompt_token_ids)
    bare = base64.b64encode(JPEG).decode()  # SGLang's bare base64
    r = http.post("/generate", json={"text": [text, "No image."],
                                     "image_data": [[data_url(PNG), bare], None],
                                     "sampling_params": sp})
    assert r.status_code == 200, r.text
    plain = vl_llm.generate(["No image."], greedy(8))[0]
    assert [o["output_ids"] for o in r.json()] == [want.outputs[0].token_ids,
                                                  plain.outputs[0].token_ids]


def test_chat_prompt_equals_moonshots_and_tokens_the_engines(
        http: httpx.Client, vl_llm: LLM, vl_ckpt: Path, host: MediaHost) -> None:
    """A chat with two images: /tokenize gives Moonshot's renderer's ids with mlx-vlm's image
    prompts, usage counts the image tokens, and the greedy tokens are the engine's."""
    from mlx_vlm.models.kimi_k3 import ImageProcessor
    from mlx_vlm.models.kimi_k3.processing_kimi_k3 import KimiK3Processor

    from tests.conftest import load_encoding_k3, reference_ids

    messages = two_images(host)
    tok = Tokenizer.from_pretrained(vl_ckpt)
    ims = [decoded(PNG), decoded(JPEG)]
    grids = ImageProcessor().preprocess(ims)["grid_thws"]
    prompts = [KimiK3Processor.make_image_prompt(None, *im.size, int(t * h * w) // 4)
               for im, (t, h, w) in zip(ims, grids, strict=True)]
    moonshot = load_encoding_k3()

    def want(thinking: bool, images: list[str] = prompts) -> list[int]:
        return reference_ids(tok, moonshot.build_chat_segments(
            messages, None, add_generation_prompt=True, thinking=thinking,
            image_prompts=images))

    want_ids = want(False)
    kwargs = {"chat_template_kwargs": {"thinking": False}}
    r = http.post("/tokenize", json={"messages": messages})  # the default: thinking on
    assert r.status_code == 200, r.text
    thinking_ids = r.json()["tokens"]
    assert thinking_ids == want(True)
    markers = want(False, ["<|media_pad|>"] * 2)  # what the engine expands itself
    ref = vl_llm.generate(prompt_token_ids=[markers], sampling_params=greedy(6),
                          image_data=[ims])[0].outputs[0].token_ids
    r = http.post(CHAT, json={"messages": messages, "max_tokens": 6, "temperature": 0,
                              "ignore_eos": True, "logprobs": True, **kwargs})
    assert r.status_code == 200, r.text
    body = r.json()
    pads = sum(t == tok.special_tokens["<|media_pad|>"] for t in want_ids)
    assert pads == 28  # 24 + 4: both images counted as prompt tokens
    assert body["usage"]["prompt_tokens"] == len(want_ids) - 3  # the channel opener: output
    got = [c["token"] for c in body["choices"][0]["logprobs"]["content"]]
    assert got == [tok.decode([t], skip_special_tokens=False) for t in ref]
    # the Responses API's input_image: the same prompt, the same answer
    r = http.post("/v1/responses", json={
        "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "What differs between "},
            {"type": "input_image", "image_url": data_url(PNG)},
            {"type": "input_text", "text": " and "},
            {"type": "input_image", "image_url": host.url("/a.jpg"), "detail": "auto"},
            {"type": "input_text", "text": "?"}]}],
        "max_output_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] == len(thinking_ids) - 3
    items = http.get(f"/v1/responses/{r.json()['id']}/input_items").json()["data"]
    assert [p["type"] for p in items[0]["content"]] == ["input_text", "input_image"] * 2 + [
        "input_text"]
    assert items[0]["content"][1]["image_url"] == data_url(PNG)


def test_second_turn_about_the_same_image_hits_the_cache(http: httpx.Client,
                                                         vl_llm: LLM) -> None:
    """The same image again: the prefix cache holds the prompt past it. Another image of the
    same size: no hit past its first pad."""
    tail = " and then a long question about it" * 6

    def ask(png: bytes) -> dict[str, Any]:
        r = http.post(CHAT, json={"messages": [{"role": "user", "content": [
            {"type": "text", "text": "Here:"}, image_part(data_url(png)),
            {"type": "text", "text": tail}]}], "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    first = ask(PNG)
    again = ask(PNG)
    tok = vl_llm.engine.tokenizer
    assert tok is not None
    r = http.post("/tokenize", json={"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Here:"}, image_part(data_url(PNG)),
        {"type": "text", "text": tail}]}]})
    ids = r.json()["tokens"]
    pad = tok.special_tokens["<|media_pad|>"]
    first_pad = ids.index(pad)
    end_of_image = len(ids) - ids[::-1].index(pad)
    assert again["prompt_tokens"] == first["prompt_tokens"]
    assert again["prompt_tokens_details"]["cached_tokens"] >= end_of_image
    other = ask(OTHER_PNG)
    assert other["prompt_tokens_details"]["cached_tokens"] <= first_pad


def _pixel_bomb() -> bytes:
    return encoded(Image.new("L", (3000, 3000)))  # 9 M pixels in a few kB


def _hostile(host: MediaHost) -> list[tuple[str, Any, str]]:
    """(case, content part or a whole request body, what the 400 says)."""
    half_png, half_jpeg = PNG[:len(PNG) // 2], JPEG[:len(JPEG) // 2]
    big = encoded(noise(190, 190, 9))  # ~108 kB of noise: under the pixels, over the bytes
    return [
        ("truncated png", image_part(data_url(half_png)), "could not be decoded"),
        ("truncated jpeg", image_part(data_url(half_jpeg, "image/jpeg")), "could not be decoded"),
        ("pixel bomb", image_part(data_url(_pixel_bomb())), "--max-image-pixels"),
        ("file too big", image_part(data_url(big + big)), "--max-image-bytes"),
        ("not an image", image_part(data_url(b"hello, world")), "not an image"),
        ("text data url", image_part(data_url(PNG, "text/plain")), "not an image type"),
        ("bad base64", image_part("data:image/png;base64,@@@@"), "malformed"),
        ("html url", image_part(host.url("/page")), "content type is 'text/html'"),
        ("host not allowed", image_part(host.url("/a.jpg", "localhost")),
         "--allowed-media-domains"),
        ("redirect", image_part(host.url("/moved")), "HTTP 302"),
        ("missing", image_part(host.url("/nothing.png")), "HTTP 404"),
        ("slow", image_part(host.url("/slow.png")), "--media-fetch-timeout"),
        ("file path", image_part("/etc/passwd"), "data: URL or an http"),
        ("bad port", image_part(host.url("/a.jpg").replace(f":{host.port}", ":port")),
         "malformed image URL"),
        ("detail", {"type": "image_url", "image_url": {"url": data_url(PNG), "detail": "high"}},
         "detail 'high'"),
        ("too many", [image_part(data_url(JPEG))] * 4, "--limit-mm-per-prompt"),
        ("too many tokens", [image_part(data_url(PNG))] * 3, "--max-image-tokens"),
    ]


def test_a_host_dripping_its_headers_is_cut_off_at_the_deadline(http: httpx.Client,
                                                                 host: MediaHost) -> None:
    """--media-fetch-timeout bounds the whole fetch, headers included (each byte arrives well
    within a read timeout): the 400 comes at the deadline, not when the host is done."""
    started = time.monotonic()
    r = http.post(CHAT, json={"messages": [{"role": "user", "content": [
        image_part(host.url("/drip.png")), {"type": "text", "text": "?"}]}], "max_tokens": 2})
    assert r.status_code == 400 and "--media-fetch-timeout" in r.json()["error"]["message"]
    assert time.monotonic() - started < DRIP / 2  # the deadline is FETCH_TIMEOUT


def test_hostile_images_are_refused_beside_normal_traffic(http: httpx.Client, vl_llm: LLM,
                                                          host: MediaHost) -> None:
    """Each hostile image is a 400 naming what is wrong, while a normal image request runs;
    that one ends with the engine's tokens, and nothing is left allocated."""
    text = "Describe<|media_pad|> it."
    want = vl_llm.generate([text], greedy(24), image_data=[[decoded(PNG)]])[0]
    result: dict[str, Any] = {}

    def normal() -> None:
        with httpx.Client(base_url=str(http.base_url), timeout=120.0) as c:
            result["r"] = c.post("/generate", json={
                "text": text, "image_data": [data_url(PNG)],
                "sampling_params": {"max_new_tokens": 24, "temperature": 0,
                                    "ignore_eos": True}})

    worker = threading.Thread(target=normal)
    worker.start()
    for case, part, says in _hostile(host):
        parts = part if isinstance(part, list) else [part]
        r = http.post(CHAT, json={"messages": [{"role": "user", "content": [
            *parts, {"type": "text", "text": "?"}]}], "max_tokens": 2})
        assert r.status_code == 400, (case, r.text)
        assert says in r.json()["error"]["message"], (case, r.text)
    r = http.post("/v1/responses", json={"input": [{"role": "user", "content": [
        {"type": "input_image", "file_id": "file-1"}]}]})
    assert r.status_code == 400 and "file_id" in r.text
    r = http.post("/generate", json={"text": "no marker", "image_data": data_url(PNG)})
    assert r.status_code == 400 and "marks 0 images" in r.text
    r = http.post("/generate", json={"text": "a marker<|media_pad|>"})
    assert r.status_code == 400 and "0 were given" in r.text
    worker.join()
    assert result["r"].status_code == 200
    assert result["r"].json()["output_ids"] == want.outputs[0].token_ids
    assert is_idle(wait_idle(http))
    assert http.get("/check_integrity").status_code == 200


def test_a_text_model_refuses_images(server: ServerProc) -> None:
    """The shared Kimi Linear server (no vision tower): an image part is a 400 saying so."""
    r = httpx.post(f"{server.url}{CHAT}", timeout=60, json={"messages": [{"role": "user",
                   "content": [image_part(data_url(PNG))]}], "max_tokens": 2})
    assert r.status_code == 400 and "this model takes no images" in r.text
