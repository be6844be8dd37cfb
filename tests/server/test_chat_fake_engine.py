"""Chat completions over a scripted engine (FastAPI TestClient, no model): what a Kimi model
emits — kimi_k2 tool calls, <think> reasoning — comes out as OpenAI `tool_calls` /
`reasoning_content`, streamed (name first, then argument deltas) and not."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kdaserve.client.request_client import EngineClient
from kdaserve.request import CompletionOutput, RequestOptions, RequestOutput, SamplingParams
from kdaserve.server.api import ServerState, create_app
from kdaserve.server.chat import ChatHandler
from kdaserve.server.chat_template import ChatTemplate
from kdaserve.server.metrics import ServerMetrics
from kdaserve.tokenizer import Tokenizer
from kdaserve.tokenizer_writer import write_kimi_tokenizer

CALL = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
        '<|tool_call_argument_begin|>{"city": "Paris", "unit": "C"}<|tool_call_end|>'
        '<|tool_calls_section_end|>')
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


class ScriptedEngine(EngineClient):
    """Yields `script` a few characters per update, like an engine decoding it."""

    def __init__(self, script: str) -> None:
        super().__init__()
        self.script = script
        self.seen_params: list[SamplingParams] = []

    def _send(self, cmd: tuple[Any, ...]) -> None:  # pragma: no cover - never used
        raise AssertionError("scripted engine takes no commands")

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       rid: str | None = None, options: RequestOptions | None = None,
                       images: Any = None) -> AsyncIterator[RequestOutput]:
        assert params is not None
        self.seen_params.append(params)
        for end in range(3, len(self.script) + 3, 3):
            text = self.script[:end]
            done = end >= len(self.script)
            yield RequestOutput(rid or "r", list(prompt), [CompletionOutput(
                0, list(range(end // 3)), text, "stop" if done else None)], finished=done)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Path]:
    path = tmp_path_factory.mktemp("tok")
    write_kimi_tokenizer(path, 4096)
    return Tokenizer.from_pretrained(path), path


def client(tok: tuple[Tokenizer, Path], script: str,
           reasoning: str | None = None) -> tuple[TestClient, ScriptedEngine]:
    engine = ScriptedEngine(script)
    tokenizer, path = tok
    state = ServerState(engine, tokenizer, "kimi", str(path), 100_000, ServerMetrics(),
                        ChatHandler(ChatTemplate.from_pretrained(path), tokenizer, reasoning))
    return TestClient(create_app(state)), engine


def chunks(resp: Any) -> list[dict[str, Any]]:
    lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


BODY = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS}


def test_tool_call_non_streaming(tok) -> None:
    c, engine = client(tok, "Let me check." + CALL)
    r = c.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    (call,) = choice["message"]["tool_calls"]
    assert call["id"] == "functions.get_weather:0" and call["type"] == "function"
    assert call["function"] == {"name": "get_weather",
                                "arguments": '{"city": "Paris", "unit": "C"}'}
    # the tool-call markers reach the parser; other special tokens stay out of the text
    params = engine.seen_params[0]
    markers = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>",
               "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_calls_section_end|>")
    kept = {tok[0].token_to_id(m) for m in markers}
    assert params.skip_special_tokens and kept <= set(params.keep_special_ids)


def test_tool_call_streaming_name_first_then_argument_deltas(tok) -> None:
    c, _ = client(tok, "Let me check." + CALL)
    with c.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as r:
        assert r.status_code == 200
        events = chunks(r)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert content == "Let me check." and "<|" not in content
    assert calls[0]["function"]["name"] == "get_weather"
    assert calls[0]["id"] == "functions.get_weather:0"
    assert all("name" not in tc.get("function", {}) for tc in calls[1:])
    assert "".join(tc["function"].get("arguments", "") for tc in calls) == \
        '{"city": "Paris", "unit": "C"}'
    assert len(calls) > 2  # arguments arrive in pieces
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_reasoning_content_split(tok) -> None:
    script = "<think>The user wants a greeting.</think>Hello!"
    c, _ = client(tok, script, reasoning="kimi_k2")
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    msg = c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert msg["reasoning_content"] == "The user wants a greeting."
    assert msg["content"] == "Hello!"
    with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        deltas = [e["choices"][0]["delta"] for e in chunks(r) if e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == \
        "The user wants a greeting."
    assert "".join(d.get("content") or "" for d in deltas) == "Hello!"


def test_plain_answer_with_tools_offered(tok) -> None:
    c, _ = client(tok, "It is sunny.")
    choice = c.post("/v1/chat/completions", json=BODY).json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == "It is sunny."
    assert "tool_calls" not in choice["message"]
