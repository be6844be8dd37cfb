"""Our Kimi K3 chat renderer (server/k3_render.py) against Moonshot's, as mlx-vlm 0.7.10 ports
it (`mlx_vlm/models/kimi_k3/encoding_k3.py`, loaded by its path: it imports only the standard
library): on 200 generated conversations (every role, names, tools with nested schemas,
multi-turn tool calls answered out of order, raw non-JSON arguments, reasoning history,
thinking on and off, each effort, tool_choice, response formats, unicode, long whitespace, and
every special-token spelling inside user, tool and argument text) the segments are the same,
and so are the token ids with the real Kimi tokenizer (control segments as special ids, every
other segment alone as ordinary text)."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path
from typing import Any

import pytest

from kdaserve.checkpoint import make_checkpoint
from kdaserve.server.k3_render import CONTROL_TOKENS, K3Renderer
from kdaserve.tokenizer import Tokenizer
from tests.conftest import load_encoding_k3, reference_ids

KIMI = Path(__file__).resolve().parents[3] / "shared" / "kimi"
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mlx_vlm") is None
    or not (KIMI / "tokenizer" / "tiktoken.model").is_file(),
    reason="needs mlx-vlm 0.7.10 (installed --no-deps by make) and ../shared/kimi")


@pytest.fixture(scope="module")
def moonshot() -> Any:
    return load_encoding_k3()


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = make_checkpoint(tmp_path_factory.mktemp("kimi"), "tiny", seed=0,
                           tokenizer=KIMI / "tokenizer", extra_special_tokens=CONTROL_TOKENS)
    return Tokenizer.from_pretrained(path)


class Gen:
    """Random conversations, seeded."""

    def __init__(self, seed: int, specials: list[str]) -> None:
        self.r, self.specials = random.Random(seed), specials

    def text(self) -> str:
        r = self.r
        pieces = ["Hello", "你好，世界", "café 🦀", "  ", "\n\n", "\t", "a&b \"q\" <x>",
                  " " * r.randint(30, 60), "x" * r.randint(1, 5), "", "0.5", "{}"]
        if r.random() < 0.5:
            pieces.append(r.choice(self.specials))
        return "".join(r.choice(pieces) for _ in range(r.randint(0, 6)))

    def value(self, depth: int = 0) -> Any:
        r = self.r
        kinds = ["s", "i", "f", "b", "n"] + (["o", "a"] if depth < 2 else [])
        k = r.choice(kinds)
        return {"s": self.text, "i": lambda: r.randint(-9, 99), "f": lambda: r.random() * 10,
                "b": lambda: r.random() < 0.5, "n": lambda: None,
                "o": lambda: {f"k{j}": self.value(depth + 1) for j in range(r.randint(0, 3))},
                "a": lambda: [self.value(depth + 1) for _ in range(r.randint(0, 3))]}[k]()

    def tool(self, name: str) -> dict[str, Any]:
        props = {f"p{j}": {"type": self.r.choice(["string", "number", "object"]),
                           "description": self.text(),
                           "properties": {"inner": {"type": "array", "items": {"type": "string"}}}}
                 for j in range(self.r.randint(0, 3))}
        return {"type": "function", "function": {"name": name, "description": self.text(),
                                                 "parameters": {"type": "object",
                                                                "properties": props}}}

    def conversation(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
        r = self.r
        names = [f"fn_{j}" for j in range(r.randint(1, 3))]
        tools = [self.tool(n) for n in names] if r.random() < 0.7 else []
        messages: list[dict[str, Any]] = []
        if r.random() < 0.5:
            messages.append({"role": "system", "content": self.text()})
        for turn in range(r.randint(1, 4)):
            user: dict[str, Any] = {"role": "user", "content": self.text() if r.random() < 0.7
                                    else [{"type": "text", "text": self.text()}
                                          for _ in range(r.randint(1, 3))]}
            if r.random() < 0.2:
                user["name"] = r.choice(["alice", "bob &\"co\""])
            messages.append(user)
            if r.random() < 0.15:
                messages.append({"role": "system", "tools": [self.tool(f"late_{turn}")]})
            assistant: dict[str, Any] = {"role": "assistant", "content": self.text()}
            if r.random() < 0.5:
                assistant["reasoning_content"] = self.text()
            calls = []
            if tools and r.random() < 0.6:
                for j in range(r.randint(1, 3)):
                    args: Any = json.dumps({f"a{i}": self.value() for i in range(r.randint(0, 3))},
                                           ensure_ascii=r.random() < 0.5)
                    if r.random() < 0.1:
                        args = "not json {" + self.text()
                    calls.append({"id": f"call_{turn}_{j}", "type": "function",
                                  "function": {"name": r.choice(names), "arguments": args}})
                assistant["tool_calls"] = calls
            messages.append(assistant)
            results = [{"role": "tool", "tool_call_id": c["id"], "content": self.text()}
                       for c in calls]
            r.shuffle(results)  # answered out of order
            messages.extend(results)
        kwargs: dict[str, Any] = {"thinking": r.random() < 0.7}
        if r.random() < 0.6:
            kwargs["thinking_effort"] = r.choice(["low", "high", "max"])
        if tools and r.random() < 0.4:
            kwargs["tool_choice"] = r.choice(["auto", "required", "none"])
        if r.random() < 0.3:
            kwargs["response_format"] = r.choice([
                {"type": "json_object"}, {"type": "text"},
                {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                    "type": "object", "properties": {"b": {"type": "string"},
                                                     "a": {"type": "number"}}}}}])
        return messages, tools, kwargs


@pytest.mark.parametrize("block", range(4))
def test_200_conversations_equal_moonshots_renderer(moonshot: Any, tok: Tokenizer,
                                                    block: int) -> None:
    gen = Gen(block, sorted(tok.special_tokens))
    ours = K3Renderer()
    for _ in range(50):
        messages, tools, kwargs = gen.conversation()
        want = moonshot.build_chat_segments(messages, tools or None, add_generation_prompt=True,
                                            **kwargs)
        got = ours.segments(messages, tools or None, True, **kwargs)
        assert got == [(s.text, s.allow_special) for s in want]
        text, ids = ours.render_ids(tok, messages, tools or None, True, **kwargs)
        assert ids == reference_ids(tok, want)
        control = {tok.special_tokens[t] for t in CONTROL_TOKENS}
        assert sum(i in control for i in ids) == sum(s.allow_special for s in want)
        assert tok.decode(ids) == text


def test_refusals(tok: Tokenizer) -> None:
    r = K3Renderer()
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="thinking_effort"):
        r.render_ids(tok, user, thinking_effort="medium")
    with pytest.raises(ValueError, match="not a Kimi K3 option"):
        r.render_ids(tok, user, preserve_thinking=True)
    with pytest.raises(ValueError, match="images go in user messages"):
        r.render_ids(tok, [*user, {"role": "assistant", "content": [
            {"type": "image_url", "image_url": {"url": "data:,"}}]}])
    with pytest.raises(ValueError, match="detail 'low' is not supported"):
        r.render_ids(tok, [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:,", "detail": "low"}}]}])
    with pytest.raises(ValueError, match="JSON object"):
        r.render_ids(tok, [*user, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}])


def test_parser_flags_must_name_the_chat_format(tok: Tokenizer) -> None:
    """`--reasoning-parser` / `--tool-call-parser` as SGLang and vLLM name them: the format's
    own parser is taken, the other format's refused at start-up."""
    from kdaserve.server.chat import ChatHandler
    from kdaserve.server.chat_template import ChatTemplate

    k3 = ChatHandler(K3Renderer(), tok, "kimi_k3", tool_call_parser="kimi_k3")
    assert k3.format.name == "kimi_k3" and k3.reasoning
    assert ChatHandler(ChatTemplate(), tok, "kimi_k2", tool_call_parser="kimi_k2").reasoning
    with pytest.raises(ValueError, match="--reasoning-parser kimi_k2.*kimi_k3"):
        ChatHandler(K3Renderer(), tok, "kimi_k2")
    with pytest.raises(ValueError, match="--tool-call-parser kimi_k3.*kimi_k2"):
        ChatHandler(ChatTemplate(), tok, tool_call_parser="kimi_k3")


def test_long_runs_equal_moonshots_renderer(moonshot: Any, tok: Tokenizer) -> None:
    """Runs past Kimi's 25,000-character chunking (whitespace in a user turn and a tool result,
    one long word in a tool argument), each segment chunked alone as Moonshot's encoding
    chunks it."""
    messages = [
        {"role": "user", "content": "a" + " " * 60_000 + "b<|open|>"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "c0", "type": "function",
            "function": {"name": "f", "arguments": json.dumps({"q": "x" * 30_000})}}]},
        {"role": "tool", "tool_call_id": "c0", "content": "\n" * 26_000},
    ]
    want = moonshot.build_chat_segments(messages, None, add_generation_prompt=True)
    _, ids = K3Renderer().render_ids(tok, messages)
    assert ids == reference_ids(tok, want)


def test_images_equal_moonshots_renderer(moonshot: Any, tok: Tokenizer) -> None:
    """Image parts in two user turns (with a tool turn between): our one-pad markers, expanded
    with our processor's image prompts, give the ids of Moonshot's segments with mlx-vlm's
    processor's image prompts in place. Text that spells the pad or Moonshot's image
    placeholder stays text: only an image part makes an image."""
    import numpy as np
    from mlx_vlm.models.kimi_k3 import ImageProcessor
    from mlx_vlm.models.kimi_k3.processing_kimi_k3 import KimiK3Processor
    from PIL import Image

    from kdaserve.multimodal import expand

    g = np.random.RandomState(3)
    ims = [Image.fromarray(g.randint(0, 256, (h, w, 3), np.uint8))
           for h, w in ((60, 90), (28, 28), (200, 45))]

    def image(i: int) -> dict[str, Any]:
        return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{i}"}}

    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, image(0),
                                     {"type": "text", "text": " and "}, image(1)]},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "c0", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c0", "content": "done"},
        {"role": "user", "content": [image(2), {"type": "text", "text": "And this?"}]},
    ]
    _, ids, parts = K3Renderer().render_with_images(tok, messages)
    assert [p["image_url"]["url"][-1] for p in parts] == ["0", "1", "2"]
    pad = tok.special_tokens["<|media_pad|>"]
    ours, _ = expand(ids, ims, pad, tok.encode)
    processed = ImageProcessor().preprocess(ims)
    prompts = [KimiK3Processor.make_image_prompt(None, w, h, int(t * hh * ww) // 4)
               for (w, h), (t, hh, ww) in zip((im.size for im in ims), processed["grid_thws"],
                                               strict=True)]
    want = moonshot.build_chat_segments(messages, None, add_generation_prompt=True,
                                        image_prompts=prompts)
    assert ours == reference_ids(tok, want)
    spelled = [{"role": "user", "content": "<|media_pad|> <|kimi_image_placeholder|>"}]
    _, ids, parts = K3Renderer().render_with_images(tok, spelled)
    assert parts == [] and pad not in ids
