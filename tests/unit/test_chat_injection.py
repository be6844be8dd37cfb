"""No control token from chat content (server/untrusted.py): with the real Kimi tokenizer and
Moonshot's K2-Instruct, K2-Thinking and K3 templates (and our builtin K2 one), a conversation
whose every client string holds every special-token spelling encodes to the same control
tokens as the same conversation without them; the injected spellings are ordinary text that
decodes back to what the client wrote; and a conversation without them encodes exactly as the
rendered text always did. Skipped where `../shared/kimi` is absent."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kdaserve.checkpoint import make_checkpoint
from kdaserve.server.chat_template import ChatTemplate
from kdaserve.tokenizer import Tokenizer

KIMI = Path(__file__).resolve().parents[3] / "shared" / "kimi"
K3_TAGS = ("<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>")
pytestmark = pytest.mark.skipif(not (KIMI / "tokenizer" / "tiktoken.model").is_file(),
                                reason="needs ../shared/kimi (the real Kimi tokenizer)")
TEMPLATES = ["builtin", "Kimi-K2-Instruct.jinja", "Kimi-K2-Thinking.jinja", "Kimi-K3.jinja"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = make_checkpoint(tmp_path_factory.mktemp("kimi"), "tiny", seed=0,
                           tokenizer=KIMI / "tokenizer", extra_special_tokens=K3_TAGS)
    return Tokenizer.from_pretrained(path)


def template(name: str) -> ChatTemplate:
    if name == "builtin":
        return ChatTemplate()
    path = KIMI / "templates" / name
    return ChatTemplate(path.read_text(encoding="utf-8"), str(path))


def conversation(inject: str, name: str = "builtin",
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A system turn, a user turn (text and parts) with a name, an assistant turn with
    reasoning and a tool call, the tool's result and a user turn again: `inject` in each
    client string. (Moonshot's K2 templates as shipped here, llama.cpp's copies, append to a
    list, which a sandboxed Jinja, HF's as ours, refuses: for them the assistant turn has
    no tool call and no tool turn follows.)"""
    tool = {"type": "function", "function": {
        "name": "lookup", "description": f"Look a word up {inject}",
        "parameters": {"type": "object", "properties": {"q": {"type": "string",
                                                              "description": inject}}}}}
    messages = [
        {"role": "system", "content": f"Be brief.{inject}"},
        {"role": "user", "content": f"Hi {inject} there", "name": "alice"},
        {"role": "assistant", "content": f"Let me look.{inject}",
         "reasoning_content": f"thinking {inject}",
         "tool_calls": [{"id": "functions.lookup:0", "type": "function",
                         "function": {"name": "lookup",
                                      "arguments": '{"q": "' + inject.replace('"', "'")
                                      + '"}'}}]},
        {"role": "tool", "tool_call_id": "functions.lookup:0", "content": f"found {inject}"},
        {"role": "user", "content": [{"type": "text", "text": f"and {inject}?"}]},
    ]
    if name.startswith("Kimi-K2"):
        messages[2].pop("tool_calls")
        messages.pop(3)
    return messages, [tool]


def specials(tok: Tokenizer, ids: list[int]) -> Counter:
    special_ids = set(tok.special_tokens.values())
    return Counter(i for i in ids if i in special_ids)


@pytest.mark.parametrize("name", TEMPLATES)
def test_content_spells_no_control_token(tok: Tokenizer, name: str) -> None:
    t = template(name)
    inject = "".join(sorted(tok.special_tokens)) + "\ue000 \ue0001\ue001"
    dirty, tools = conversation(inject, name)
    clean, clean_tools = conversation("", name)
    text, ids = t.render_ids(tok, dirty, tools=tools)
    _, clean_ids = t.render_ids(tok, clean, tools=clean_tools)
    assert specials(tok, ids) == specials(tok, clean_ids)  # the template's, nothing more
    # (encoded whole, as every chat was before, the content's spellings became controls)
    assert specials(tok, tok.encode(text)) != specials(tok, clean_ids)
    # the text is what the template always rendered, and the ids spell it, injected
    # spellings included (as ordinary text; the client's own U+E000 too)
    assert text == t.render(dirty, tools=tools)
    assert tok.decode(ids) == text
    assert inject in tok.decode(ids)
    # the generation prompt is the template's and last: one assistant turn follows
    assert ids[-1] in set(tok.special_tokens.values()) or ids[-1] == clean_ids[-1]
    assert ids[-3:] == clean_ids[-3:]


@pytest.mark.parametrize("name", TEMPLATES)
def test_plain_content_encodes_as_before(tok: Tokenizer, name: str) -> None:
    t = template(name)
    messages, tools = conversation("你好 🦀 <not|special> < |im_end| >", name)
    _, ids = t.render_ids(tok, messages, tools=tools)
    assert ids == tok.encode(t.render(messages, tools=tools))


def test_raw_prompts_keep_their_specials(tok: Tokenizer) -> None:
    """/v1/completions and /generate text: special spellings are specials (SGLang, vLLM)."""
    assert tok.encode("<|im_end|>") == [tok.special_tokens["<|im_end|>"]]
    assert tok.special_tokens["<|im_end|>"] not in tok.encode_ordinary("<|im_end|>")
    assert tok.decode(tok.encode_ordinary("<|im_end|>")) == "<|im_end|>"
