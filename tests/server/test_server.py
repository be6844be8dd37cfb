"""The OpenAI API of a real `kdaserve serve` process, driven by the `openai` client: greedy
outputs equal `LLM.generate` on the same prompt ids, streaming equals non-streaming, usage counts
are exact, many requests at once are each right."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import httpx
import openai
import pytest

from kdaserve import LLM, SamplingParams
from kdaserve.server.chat_template import ChatTemplate
from kdaserve.server.tool_parser import parse_tool_calls
from kdaserve.tokenizer import Tokenizer

from .conftest import (
    IGNORE_EOS,
    NEW,
    ServerProc,
    chat_ids,
    greedy,
    is_clear,
    post_generate,
    reference,
    token_str,
)

LP_TOL = 1e-4  # logprobs of the same token from differently batched forwards

TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


# ---- completions ----
def test_completion_greedy_equals_llm(client: openai.OpenAI, http: httpx.Client, model: str,
                                      llm: LLM, tok: Tokenizer,
                                      prompts: list[list[int]]) -> None:
    ids = prompts[5]
    ref = reference(llm, [ids], greedy(NEW, logprobs=2))[0].outputs[0]
    assert ref.logprobs is not None

    r = client.completions.create(model=model, prompt=ids, max_tokens=NEW, temperature=0,
                                  logprobs=2, extra_body=IGNORE_EOS)
    assert r.object == "text_completion" and r.id and len(r.choices) == 1
    c = r.choices[0]
    assert (c.index, c.text, c.finish_reason) == (0, ref.text, "length")
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(ids), NEW, len(ids) + NEW)
    assert c.logprobs is not None and c.logprobs.tokens is not None
    assert c.logprobs.tokens == [token_str(tok, t) for t in ref.token_ids]
    assert c.logprobs.token_logprobs == pytest.approx(
        [lp[t] for t, lp in zip(ref.token_ids, ref.logprobs, strict=True)], abs=LP_TOL)

    # the token ids themselves, through SGLang's /generate
    g = post_generate(http, {"input_ids": ids, "sampling_params": {
        "max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}})
    assert g["output_ids"] == ref.token_ids and g["text"] == ref.text


def test_completion_text_prompt_and_stream(client: openai.OpenAI, model: str, llm: LLM,
                                           tok: Tokenizer) -> None:
    texts = [f"Once upon a time, story {i} began" for i in range(20)]
    text = next(t for t in texts if is_clear(llm, tok.encode(t), NEW))
    ids = tok.encode(text)
    ref = reference(llm, [ids], greedy(NEW))[0].outputs[0]

    full = client.completions.create(model=model, prompt=text, max_tokens=NEW, temperature=0,
                                     extra_body=IGNORE_EOS)
    assert full.choices[0].text == ref.text
    assert full.usage is not None and full.usage.prompt_tokens == len(ids)

    chunks = list(client.completions.create(
        model=model, prompt=text, max_tokens=NEW, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=IGNORE_EOS))
    *content, usage = chunks
    assert all(ch.object == "text_completion" and ch.id == content[0].id for ch in chunks)
    assert "".join(ch.choices[0].text for ch in content) == ref.text
    assert [ch.choices[0].finish_reason for ch in content][-1] == "length"
    assert all(ch.choices[0].finish_reason is None for ch in content[:-1])
    assert all(ch.usage is None for ch in content)
    assert usage.choices == [] and usage.usage is not None
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens,
            usage.usage.total_tokens) == (len(ids), NEW, len(ids) + NEW)


def test_completion_batch_of_prompts(client: openai.OpenAI, model: str, llm: LLM,
                                     prompts: list[list[int]]) -> None:
    batch = prompts[:3]
    refs = reference(llm, batch, greedy(NEW))
    r = client.completions.create(model=model, prompt=batch, max_tokens=NEW, temperature=0,
                                  extra_body=IGNORE_EOS)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [o.outputs[0].text for o in refs]
    assert r.usage is not None
    assert r.usage.prompt_tokens == sum(map(len, batch))
    assert r.usage.completion_tokens == 3 * NEW


# ---- chat ----
def test_chat_greedy_equals_llm(client: openai.OpenAI, http: httpx.Client, model: str, llm: LLM,
                                tok: Tokenizer, template: ChatTemplate,
                                conversations: list[list[dict[str, Any]]]) -> None:
    for messages in conversations[:2]:  # with and without a system prompt
        ids = chat_ids(tok, template, messages)
        ref = reference(llm, [ids], greedy(NEW, logprobs=2))[0].outputs[0]
        assert ref.logprobs is not None

        r = client.chat.completions.create(model=model, messages=messages, max_tokens=NEW,
                                           temperature=0, logprobs=True, top_logprobs=2,
                                           extra_body=IGNORE_EOS)
        assert r.object == "chat.completion" and len(r.choices) == 1
        c = r.choices[0]
        assert c.message.role == "assistant" and c.message.content == ref.text
        assert not c.message.tool_calls and c.finish_reason == "length"
        assert r.usage is not None
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), NEW)
        assert c.logprobs is not None and c.logprobs.content is not None
        assert [e.token for e in c.logprobs.content] == [token_str(tok, t) for t in ref.token_ids]
        assert [e.logprob for e in c.logprobs.content] == pytest.approx(
            [lp[t] for t, lp in zip(ref.token_ids, ref.logprobs, strict=True)], abs=LP_TOL)

        g = post_generate(http, {"input_ids": ids, "sampling_params": {
            "max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}})
        assert g["output_ids"] == ref.token_ids


def test_chat_stream_equals_non_stream(client: openai.OpenAI, model: str, tok: Tokenizer,
                                       template: ChatTemplate,
                                       conversations: list[list[dict[str, Any]]]) -> None:
    messages = conversations[2]
    ids = chat_ids(tok, template, messages)
    kw: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": NEW,
                          "temperature": 0, "logprobs": True, "top_logprobs": 1,
                          "extra_body": IGNORE_EOS}
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    *body, usage = chunks
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    assert body[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in body)
    assert text == full.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in body if ch.choices[0].finish_reason] == [
        "length"]
    assert body[-1].choices[0].finish_reason == "length"
    streamed_lps = [e.logprob for ch in body if ch.choices[0].logprobs is not None
                    for e in ch.choices[0].logprobs.content or []]
    assert full.choices[0].logprobs is not None and full.choices[0].logprobs.content is not None
    assert streamed_lps == pytest.approx(
        [e.logprob for e in full.choices[0].logprobs.content], abs=LP_TOL)
    assert usage.choices == [] and usage.usage is not None
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens,
            usage.usage.total_tokens) == (len(ids), NEW, len(ids) + NEW)


def test_chat_stop_token_ids(client: openai.OpenAI, model: str, llm: LLM, tok: Tokenizer,
                             template: ChatTemplate,
                             conversations: list[list[dict[str, Any]]]) -> None:
    """stop_token_ids end the output with finish_reason stop (the eos path, which a random model
    rarely takes by itself); like vLLM, a non-special stop token's text stays in the output."""
    messages = conversations[3]
    ids = chat_ids(tok, template, messages)
    ref = reference(llm, [ids], greedy(NEW))[0].outputs[0]
    stop_at = ref.token_ids[3]
    cut = ref.token_ids.index(stop_at)
    r = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                       max_tokens=NEW,
                                       extra_body={"stop_token_ids": [stop_at], **IGNORE_EOS})
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.completion_tokens == cut + 1
    assert r.choices[0].message.content == tok.decode(ref.token_ids[:cut + 1])


# ---- many at once ----
def test_concurrent_requests_each_equal_llm(server: ServerProc, model: str, llm: LLM,
                                            tok: Tokenizer, template: ChatTemplate,
                                            prompts: list[list[int]],
                                            conversations: list[list[dict[str, Any]]]) -> None:
    """48 requests in flight at once (32 completions, half streamed; 8 chats; 8 /generate)."""
    refs = reference(llm, prompts, greedy(NEW))
    chats = [chat_ids(tok, template, m) for m in conversations]
    chat_refs = reference(llm, chats, greedy(NEW))

    async def completion(oa: openai.AsyncOpenAI, i: int) -> tuple[str, int | None]:
        kw: dict[str, Any] = {"model": model, "prompt": prompts[i], "max_tokens": NEW,
                              "temperature": 0, "extra_body": IGNORE_EOS}
        if i % 2:
            r = await oa.completions.create(**kw)
            return r.choices[0].text, r.usage.completion_tokens if r.usage else None
        parts, count = [], None
        async for ch in await oa.completions.create(**kw, stream=True,
                                                    stream_options={"include_usage": True}):
            parts += [c.text for c in ch.choices]
            count = ch.usage.completion_tokens if ch.usage else count
        return "".join(parts), count

    async def chat(oa: openai.AsyncOpenAI, i: int) -> str | None:
        r = await oa.chat.completions.create(model=model, messages=conversations[i],
                                             max_tokens=NEW, temperature=0,
                                             extra_body=IGNORE_EOS)
        return r.choices[0].message.content

    async def generate(ax: httpx.AsyncClient, i: int) -> list[int]:
        r = await ax.post("/generate", json={"input_ids": prompts[32 + i], "sampling_params": {
            "max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        return list(r.json()["output_ids"])

    async def main() -> tuple[list[tuple[str, int | None]], list[str | None], list[list[int]]]:
        oa = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                                timeout=120)
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as ax:
            a, b, c = await asyncio.gather(
                asyncio.gather(*(completion(oa, i) for i in range(32))),
                asyncio.gather(*(chat(oa, i) for i in range(8))),
                asyncio.gather(*(generate(ax, i) for i in range(8))))
        await oa.close()
        return list(a), list(b), list(c)

    completions, chat_texts, generated = asyncio.run(main())
    assert completions == [(o.outputs[0].text, NEW) for o in refs[:32]]
    assert chat_texts == [o.outputs[0].text for o in chat_refs]
    assert generated == [o.outputs[0].token_ids for o in refs[32:]]


# ---- stop strings ----
def _stop_case(llm: LLM, tok: Tokenizer, prompts: list[list[int]]) -> tuple[list[int], str, str,
                                                                              int]:
    """(prompt, stop string spanning two tokens, expected text, expected completion tokens)."""
    for ids in prompts:
        if not is_clear(llm, ids, 16):
            continue
        out = reference(llm, [ids], greedy(16))[0].outputs[0]
        text = out.text or ""
        for i in range(1, 15):
            b = len(tok.decode(out.token_ids[:i]))
            if tok.decode(out.token_ids[:i]) != text[:b] or not 1 <= b - 1 < len(text) - 1:
                continue
            s = text[b - 1:b + 1]
            # ASCII, so no byte of it is held back by the UTF-8-safe detokenizer
            if s.isascii() and s.strip() == s and s.isprintable() and text.find(s) == b - 1:
                if len(tok.decode(out.token_ids[:i + 1])) > b:  # token i adds visible text
                    return ids, s, text[:b - 1], i + 1
    raise AssertionError("no prompt has a usable stop string")


def test_stop_string_spanning_tokens(client: openai.OpenAI, http: httpx.Client, model: str,
                                     llm: LLM, tok: Tokenizer, prompts: list[list[int]]) -> None:
    ids, stop, expected, num_tokens = _stop_case(llm, tok, prompts)
    kw: dict[str, Any] = {"model": model, "prompt": ids, "max_tokens": 16, "temperature": 0,
                          "stop": [stop, "\x00never"], "extra_body": IGNORE_EOS}
    r = client.completions.create(**kw)
    c = r.choices[0]
    assert (c.text, c.finish_reason) == (expected, "stop")
    assert r.usage is not None and r.usage.completion_tokens == num_tokens
    assert getattr(c, "stop_reason", stop) == stop

    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == expected  # no piece of it leaked
    assert chunks[-1].choices[0].finish_reason == "stop"

    g = post_generate(http, {"input_ids": ids, "sampling_params": {
        "max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": stop}})
    assert g["text"] == expected
    assert g["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert g["meta_info"]["completion_tokens"] == num_tokens


# ---- sampling with n and seed ----
def test_n_with_seed_is_reproducible(client: openai.OpenAI, model: str, llm: LLM,
                                     prompts: list[list[int]]) -> None:
    ids = prompts[7]
    params = SamplingParams(n=3, temperature=1.0, seed=42, max_tokens=6, ignore_eos=True)
    ref = [o.text for o in reference(llm, [ids], params)[0].outputs]
    assert len(set(ref)) > 1  # a near-uniform random model: samples differ

    kw: dict[str, Any] = {"model": model, "prompt": ids, "n": 3, "temperature": 1.0,
                          "seed": 42, "max_tokens": 6, "extra_body": IGNORE_EOS}
    r = client.completions.create(**kw)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == ref
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 18)

    parts: dict[int, str] = {0: "", 1: "", 2: ""}
    for ch in client.completions.create(**kw, stream=True):
        for c in ch.choices:
            parts[c.index] += c.text
    assert [parts[i] for i in range(3)] == ref

    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], n=2, temperature=1.0,
        seed=7, max_tokens=6, extra_body=IGNORE_EOS)
    again = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], n=2, temperature=1.0,
        seed=7, max_tokens=6, extra_body=IGNORE_EOS)
    assert [c.index for c in chat.choices] == [0, 1]
    assert [c.message.content for c in chat.choices] == [c.message.content for c in again.choices]
    assert chat.usage is not None and chat.usage.completion_tokens == 12


# ---- logprobs ----
def test_logprobs_shapes_match_generate(client: openai.OpenAI, http: httpx.Client, model: str,
                                        tok: Tokenizer, prompts: list[list[int]]) -> None:
    ids = prompts[9]
    g = post_generate(http, {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 3,
                             "return_text_in_logprobs": True,
                             "sampling_params": {"max_new_tokens": NEW, "temperature": 0,
                                                 "ignore_eos": True}})
    meta = g["meta_info"]
    triples = meta["output_token_logprobs"]
    assert len(triples) == NEW == meta["completion_tokens"]
    for (lp, tid, text), out_id in zip(triples, g["output_ids"], strict=True):
        assert isinstance(lp, float) and lp <= 0 and tid == out_id
        assert text == token_str(tok, tid)
    tops = meta["output_top_logprobs"]
    assert [len(t) for t in tops] == [3] * NEW
    for (lp, tid, _), top in zip(triples, tops, strict=True):
        assert [x[0] for x in top] == sorted((x[0] for x in top), reverse=True)
        assert (top[0][0], top[0][1]) == pytest.approx((lp, tid))  # greedy: the argmax

    r = client.completions.create(model=model, prompt=ids, max_tokens=NEW, temperature=0,
                                  logprobs=3, extra_body=IGNORE_EOS)
    lps = r.choices[0].logprobs
    assert lps is not None and lps.token_logprobs is not None and lps.top_logprobs is not None
    assert lps.token_logprobs == pytest.approx([t[0] for t in triples], abs=LP_TOL)
    for top, token, want in zip(lps.top_logprobs, lps.tokens or [], tops, strict=True):
        # a dict keyed by token text: tokens that decode alike (e.g. to U+FFFD) share a key
        assert 1 <= len(top) <= 3 and top[token] == max(top.values())
        if len(top) == 3:
            assert sorted(top.values(), reverse=True) == pytest.approx(
                [x[0] for x in want], abs=LP_TOL)

    c = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=NEW,
        temperature=0, logprobs=True, top_logprobs=3, extra_body=IGNORE_EOS)
    content = c.choices[0].logprobs.content if c.choices[0].logprobs else None
    assert content is not None and len(content) == NEW
    for e in content:
        assert len(e.top_logprobs) == 3
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] == e.logprob <= 0
        assert e.top_logprobs[0].token == e.token
        assert bytes(e.bytes or []).decode("utf-8", "replace") == e.token or "\ufffd" in e.token
    assert sum(math.exp(t.logprob) for t in content[0].top_logprobs) <= 1 + 1e-6

    plain = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


# ---- tools ----
def test_tools_render_declaration_and_valid_shapes(client: openai.OpenAI, model: str, llm: LLM,
                                                   tok: Tokenizer,
                                                   template: ChatTemplate) -> None:
    """A random model cannot be made to emit a tool call, so this checks the prompt the server
    builds (its exact token count) and the shapes of whatever comes back; the kimi_k2 parser on
    known model outputs is tested in tests/unit/test_tool_parser.py."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    with_tools = chat_ids(tok, template, messages, TOOLS)
    without = chat_ids(tok, template, messages)
    assert "tool_declare" in template.render(messages, tools=TOOLS)
    assert len(with_tools) > len(without)
    ref = reference(llm, [with_tools], greedy(NEW, skip_special_tokens=False))[0].outputs[0]
    ref_content, ref_calls = parse_tool_calls(ref.text or "")

    r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                       max_tokens=NEW, temperature=0, extra_body=IGNORE_EOS)
    assert r.usage is not None and r.usage.prompt_tokens == len(with_tools)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    assert c.message.role == "assistant"
    for call in c.message.tool_calls or []:
        assert call.type == "function" and call.id
        assert call.function.name == "get_weather"
        json.loads(call.function.arguments)
    if is_clear(llm, with_tools, NEW):
        assert len(c.message.tool_calls or []) == len(ref_calls)
        assert (c.message.content or "") == (ref_content or "")

    # streamed: same prompt, valid chunks, same content
    chunks = list(client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, max_tokens=NEW, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=IGNORE_EOS))
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == len(with_tools)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == (c.message.content or "")
    assert chunks[-2].choices[0].finish_reason == c.finish_reason

    # every tool_choice keeps the declaration in the prompt (as Moonshot's reference renders
    # it: "none" only forbids calling)
    choices: list[Any] = ["none", "auto", "required",
                          {"type": "function", "function": {"name": "get_weather"}}]
    for choice in choices:
        ok = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                            tool_choice=choice, max_tokens=1)
        assert ok.usage is not None and ok.usage.prompt_tokens == len(with_tools)


def test_tool_results_in_history(client: openai.OpenAI, model: str, tok: Tokenizer,
                                 template: ChatTemplate) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "functions.get_weather:0", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "Sunny, 21 C"},
    ]
    kw: dict[str, Any] = {"model": model, "messages": messages, "tools": TOOLS, "max_tokens": 2}
    r = client.chat.completions.create(**kw)
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(chat_ids(tok, template, messages, TOOLS))


def test_unknown_fields_are_refused(client: openai.OpenAI, model: str) -> None:
    # never accepted and ignored: a vendor extension we do not implement is a 400 naming it
    with pytest.raises(openai.BadRequestError, match="some_vendor_extension"):
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            extra_body={"some_vendor_extension": {"x": [1, 2]}})
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_body={"chat_template_kwargs": {"thinking": False}})
    assert r.choices[0].finish_reason in ("stop", "length")
