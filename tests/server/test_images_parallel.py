"""Images with every way of spreading a model over processes, on the tiny `k3-tiny-vl`
checkpoint: tensor parallelism (`--tp-size 2`: the tower on rank 0, its rows sent with the
batch), data-parallel replicas (`--dp-size 2`), DP attention with expert parallelism, and
prefill/decode disaggregation behind sglang-router. Each gives the in-process engine's greedy
tokens for prompts with images, in 32-token chunks that split them, and its pools end whole."""

from __future__ import annotations

import base64
import concurrent.futures
import io
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from kdaserve import LLM, SamplingParams
from tests.server.conftest import (
    free_port,
    start_router,
    start_server,
    stop_router,
    stop_server,
    wait_idle,
)

pytest.importorskip("sglang_router")

NEW = 6
CHUNKS = ("--max-num-batched-tokens", "32")


def png(seed: int, h: int, w: int) -> bytes:
    g = np.random.RandomState(seed)
    buf = io.BytesIO()
    Image.fromarray(g.randint(0, 256, (h, w, 3), np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


# (prompt, its images): one, two and no images; images of 24, 6 and 4 pads
CASES = [("Look<|media_pad|> what is it?", [png(0, 112, 168)]),
         ("A<|media_pad|>and<|media_pad|>differ.", [png(1, 56, 84), png(2, 56, 56)]),
         ("No image, only text here.", []),
         ("Again<|media_pad|>!", [png(0, 112, 168)])]


@pytest.fixture(scope="module")
def want(vl_ckpt: Path) -> list[list[int]]:
    llm = LLM(vl_ckpt)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate([t for t, _ in CASES], params,
                        image_data=[[Image.open(io.BytesIO(b)) for b in ims] for _, ims in CASES])
    return [o.outputs[0].token_ids for o in outs]


def generate_all(url: str) -> list[list[int]]:
    def one(case: tuple[str, list[bytes]]) -> list[int]:
        text, ims = case
        body: dict = {"text": text, "sampling_params": {"max_new_tokens": NEW, "temperature": 0,
                                                        "ignore_eos": True}}
        if ims:
            body["image_data"] = [f"data:image/png;base64,{base64.b64encode(b).decode()}"
                                  for b in ims]
        r = httpx.post(f"{url}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    with concurrent.futures.ThreadPoolExecutor(len(CASES)) as pool:
        return list(pool.map(one, CASES))


def check_whole(url: str) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        wait_idle(c, timeout=60)
        assert c.get("/check_integrity").status_code == 200


@pytest.mark.parametrize("args", [
    ("--tp-size", "2"),
    ("--dp-size", "2"),
    ("--dp-size", "2", "--enable-dp-attention", "--ep-size", "2"),
], ids=["tp", "dp", "dp-attention"])
def test_parallel_servers_equal_the_engine(vl_ckpt: Path, want: list[list[int]],
                                           tmp_path: Path, args: tuple[str, ...]) -> None:
    s = start_server(vl_ckpt, tmp_path, *args, *CHUNKS)
    try:
        assert generate_all(s.url) == want
        assert generate_all(s.url) == want  # the images' prompts from the prefix cache
        check_whole(s.url)
    finally:
        stop_server(s)


def test_disaggregated_images_equal_the_engine(vl_ckpt: Path, want: list[list[int]],
                                               tmp_path: Path) -> None:
    """The prefill server runs the tower; the decode server gets the caches of the image
    prompts (both compare the prompt with each image's content key, not its pads alone)."""
    bootstrap = free_port()
    prefill = start_server(vl_ckpt, tmp_path, "--disaggregation-mode", "prefill",
                           "--disaggregation-bootstrap-port", str(bootstrap), *CHUNKS)
    decode = start_server(vl_ckpt, tmp_path, "--disaggregation-mode", "decode", *CHUNKS)
    router = None
    try:
        router, url = start_router(["--pd-disaggregation", "--prefill", prefill.url,
                                    str(bootstrap), "--decode", decode.url],
                                   tmp_path / "router.log")
        assert generate_all(url) == want
        for s in (prefill, decode):
            check_whole(s.url)
    finally:
        if router is not None:
            stop_router(router)
        stop_server(decode)
        stop_server(prefill)
