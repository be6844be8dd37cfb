"""What the installed `openai` SDK's own types require, checked strictly on every body and every
streamed chunk or event of /v1/completions, /v1/chat/completions and /v1/responses; and the
stored responses (GET, DELETE, input_items), through the real SDK client and raw HTTP.

The main server (tests/server/conftest.py) runs the tiny checkpoint, whose output is random
text; a scripted engine behind the same app drives reasoning, text and tool-call items
through one Responses stream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion import Completion
from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent
from pydantic import TypeAdapter

from kdaserve.client.request_client import EngineClient
from kdaserve.request import CompletionOutput, RequestOptions, RequestOutput, SamplingParams
from kdaserve.server.api import ServerState, create_app
from kdaserve.server.chat import ChatHandler
from kdaserve.server.chat_template import ChatTemplate
from kdaserve.server.metrics import ServerMetrics
from kdaserve.server.responses import ResponseStore
from kdaserve.tokenizer import Tokenizer
from kdaserve.tokenizer_writer import write_kimi_tokenizer

EVENT = TypeAdapter(ResponseStreamEvent)
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]
TOOLS = [{"type": "function", "name": "get_weather", "parameters": PARAMS}]


def sse_data(r: httpx.Response) -> list[dict[str, Any]]:
    """The JSON payloads of an SSE body (without the closing [DONE], if any)."""
    assert r.status_code == 200, r.read()
    return [json.loads(line[6:]) for line in r.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def streamed(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        return sse_data(r)


def check_events(events: list[dict[str, Any]]) -> None:
    """Each Responses stream event as the SDK's event union, and its `response` (if any) as a
    whole Response; numbered 0, 1, 2, ... as OpenAI numbers them."""
    for ev in events:
        assert EVENT.validate_python(ev, strict=True).type == ev["type"]
        if "response" in ev:
            Response.model_validate(ev["response"], strict=True)
    assert [ev["sequence_number"] for ev in events] == list(range(len(events)))


# ---- the SDK's types, strictly ----
def test_completions_match_sdk_types(http: httpx.Client, model: str) -> None:
    for body in ({"prompt": "Hello", "max_tokens": 4},
                 {"prompt": ["a b", "c"], "max_tokens": 3, "n": 2, "logprobs": 2}):
        whole = http.post("/v1/completions", json={"model": model, **body})
        assert whole.status_code == 200, whole.text
        c = Completion.model_validate(whole.json(), strict=True)
        assert c.usage is not None and c.usage.completion_tokens > 0
        chunks = streamed(http, "/v1/completions", {
            "model": model, **body, "stream_options": {"include_usage": True}})
        for chunk in chunks:
            for choice in chunk["choices"]:
                # the one departure, on purpose: OpenAI streams finish_reason null until a
                # choice ends, which the SDK's Completion (shared with whole bodies) types as
                # required; every other field is checked as typed
                assert choice["finish_reason"] in (None, "stop", "length")
            final = {**chunk, "choices": [{**ch, "finish_reason": ch["finish_reason"] or "stop"}
                                          for ch in chunk["choices"]]}
            Completion.model_validate(final, strict=True)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
        ended = [x["index"] for ch in chunks for x in ch["choices"] if x["finish_reason"]]
        assert sorted(ended) == list(range(len(c.choices)))


def test_chat_completions_match_sdk_types(http: httpx.Client, model: str) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for body in ({"messages": messages, "max_tokens": 4},
                 {"messages": messages, "max_tokens": 3, "n": 2, "logprobs": True,
                  "top_logprobs": 2},
                 {"messages": messages, "max_tokens": 60, "tools": CHAT_TOOLS,
                  "tool_choice": "required", "temperature": 0}):
        whole = http.post("/v1/chat/completions", json={"model": model, **body})
        assert whole.status_code == 200, whole.text
        c = ChatCompletion.model_validate(whole.json(), strict=True)
        assert c.usage is not None and c.usage.total_tokens > 0
        chunks = streamed(http, "/v1/chat/completions", {
            "model": model, **body, "stream_options": {"include_usage": True}})
        parsed = [ChatCompletionChunk.model_validate(ch, strict=True) for ch in chunks]
        assert parsed[-1].usage is not None and parsed[-1].choices == []
        ended = [x.index for ch in parsed for x in ch.choices if x.finish_reason]
        assert sorted(ended) == list(range(len(c.choices)))  # each choice ends once
        if "tools" in body:
            assert c.choices[0].message.tool_calls
            assert any(ch.choices and ch.choices[0].delta.tool_calls for ch in parsed)


def test_responses_match_sdk_types(http: httpx.Client, model: str) -> None:
    for body in ({"input": "Name a colour.", "instructions": "Be brief.",
                  "max_output_tokens": 4},
                 {"input": "Weather in Paris?", "tools": TOOLS, "tool_choice": "required",
                  "max_output_tokens": 60, "temperature": 0}):
        whole = http.post("/v1/responses", json={"model": model, **body})
        assert whole.status_code == 200, whole.text
        r = Response.model_validate(whole.json(), strict=True)
        assert r.usage is not None
        details = r.usage.input_tokens_details
        assert details.cache_write_tokens == 0  # the prefix cache reports reads only
        assert 0 <= details.cached_tokens <= r.usage.input_tokens
        events = streamed(http, "/v1/responses", {"model": model, **body})
        check_events(events)
        kinds = {ev["type"] for ev in events}
        assert {"response.created", "response.in_progress", "response.output_item.added",
                "response.output_item.done"} <= kinds
        assert events[-1]["type"] == ("response.completed" if r.status == "completed"
                                      else "response.incomplete")
        if "tools" in body:
            assert {"response.function_call_arguments.delta",
                    "response.function_call_arguments.done"} <= kinds
            assert any(o.type == "function_call" for o in r.output)


# ---- every Responses item kind, from a scripted engine ----
CALL = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        '<|tool_calls_section_end|>')
SCRIPT = "<think>The user wants the weather.</think>Let me check." + CALL


class ScriptedEngine(EngineClient):
    """Yields SCRIPT a few characters per update, as an engine decoding it would."""

    def _send(self, cmd: tuple[Any, ...]) -> None:  # pragma: no cover - never used
        raise AssertionError("the scripted engine takes no commands")

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       rid: str | None = None, options: RequestOptions | None = None,
                       images: Any = None) -> AsyncIterator[RequestOutput]:
        for end in range(3, len(SCRIPT) + 3, 3):
            done = end >= len(SCRIPT)
            yield RequestOutput(rid or "r", list(prompt), [CompletionOutput(
                0, list(range(end // 3)), SCRIPT[:end], "stop" if done else None)],
                finished=done)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> TestClient:
    path: Path = tmp_path_factory.mktemp("tok")
    write_kimi_tokenizer(path, 4096)
    tokenizer = Tokenizer.from_pretrained(path)
    chat = ChatHandler(ChatTemplate.from_pretrained(path), tokenizer, "kimi_k2")
    state = ServerState(ScriptedEngine(), tokenizer, "kimi", str(path), 100_000,
                        ServerMetrics(), chat, responses=ResponseStore())
    return TestClient(create_app(state))


def test_reasoning_text_and_call_events_match_sdk_types(scripted: TestClient) -> None:
    body = {"input": "Weather in Paris?", "tools": TOOLS}
    with scripted.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        events = sse_data(r)
    check_events(events)
    kinds = {ev["type"] for ev in events}
    for name in ("reasoning_text", "output_text", "function_call_arguments"):
        assert {f"response.{name}.delta", f"response.{name}.done"} <= kinds, name
    assert {"response.content_part.added", "response.content_part.done"} <= kinds
    final = Response.model_validate(events[-1]["response"], strict=True)
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Let me check."
    assert final.usage is not None and final.usage.output_tokens_details.reasoning_tokens > 0
    # stored as streamed; the input items list as the SDK types them
    got = scripted.get(f"/v1/responses/{final.id}")
    assert got.status_code == 200 and got.json() == events[-1]["response"]
    page = scripted.get(f"/v1/responses/{final.id}/input_items").json()
    items = ResponseItemList.model_validate(page, strict=True)
    assert [i.type for i in items.data] == ["message"] and items.has_more is False
    # the next turn lists this one's input and output before its own input
    follow = scripted.post("/v1/responses", json={
        "previous_response_id": final.id, "tools": TOOLS,
        "input": [{"type": "function_call_output", "call_id": "functions.get_weather:0",
                   "output": "sunny"}]})
    assert follow.status_code == 200, follow.text
    Response.model_validate(follow.json(), strict=True)
    page = scripted.get(f"/v1/responses/{follow.json()['id']}/input_items",
                        params={"order": "asc"}).json()
    listed = ResponseItemList.model_validate(page, strict=True)
    assert [i.type for i in listed.data] == ["message", "reasoning", "message",
                                             "function_call", "function_call_output"]
    assert [i.id for i in listed.data[1:4]] == [o.id for o in final.output]


# ---- stored responses through the SDK ----
def test_sdk_retrieve_list_and_delete(client: openai.OpenAI, http: httpx.Client,
                                      model: str) -> None:
    first = client.responses.create(
        model=model, max_output_tokens=4, temperature=0,
        input=[{"role": "developer", "content": "Be brief."},
               {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}])
    raw = http.get(f"/v1/responses/{first.id}")
    assert raw.status_code == 200
    Response.model_validate(raw.json(), strict=True)
    got = client.responses.retrieve(first.id)
    assert got.model_dump() == first.model_dump()  # as it was returned
    second = client.responses.create(model=model, previous_response_id=first.id,
                                     input="And again?", max_output_tokens=4)
    newest_first = list(client.responses.input_items.list(second.id))
    oldest_first = list(client.responses.input_items.list(second.id, order="asc"))
    assert [i.id for i in newest_first] == [i.id for i in reversed(oldest_first)]
    # the first response's input, its output (random text: maybe none), then this input
    assert [(i.type, getattr(i, "role", None)) for i in oldest_first[:2]] == [
        ("message", "developer"), ("message", "user")]
    assert [i.id for i in oldest_first[2:-1]] == [o.id for o in first.output]
    user = oldest_first[-1]
    assert user.type == "message" and user.content[0].type == "input_text"
    assert user.content[0].text == "And again?"  # type: ignore[union-attr]
    # pages of one: the SDK follows `after` through them
    pages = client.responses.input_items.list(second.id, order="asc", limit=1)
    assert len(pages.data) == 1 and pages.has_more is True
    assert [i.id for i in pages] == [i.id for i in oldest_first]
    raw_page = http.get(f"/v1/responses/{second.id}/input_items",
                        params={"limit": 2, "after": oldest_first[0].id, "order": "asc"})
    page = ResponseItemList.model_validate(raw_page.json(), strict=True)
    assert [i.id for i in page.data] == [i.id for i in oldest_first[1:3]]
    assert (page.first_id, page.last_id, page.has_more) == (
        oldest_first[1].id, oldest_first[2].id, len(oldest_first) > 3)
    assert client.responses.delete(first.id) is None  # the SDK reads no body
    gone = http.delete(f"/v1/responses/{second.id}")
    assert gone.status_code == 200
    assert gone.json() == {"id": second.id, "object": "response.deleted", "deleted": True}
    for rid in (first.id, second.id):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(rid)
        with pytest.raises(openai.NotFoundError):
            client.responses.input_items.list(rid)


def test_streamed_response_is_stored_as_its_final_event(http: httpx.Client, model: str) -> None:
    events = streamed(http, "/v1/responses", {"model": model, "input": "Hi",
                                               "max_output_tokens": 3})
    final = events[-1]["response"]
    got = http.get(f"/v1/responses/{final['id']}")
    assert got.status_code == 200 and got.json() == final


def not_found(r: httpx.Response, rid: str) -> None:
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert rid in error["message"] and error["type"] == "NotFoundError"
    assert error["code"] == 404 and error["param"] == "response_id"


def test_store_false_is_not_kept(client: openai.OpenAI, http: httpx.Client, model: str) -> None:
    r = client.responses.create(model=model, input="Hi", max_output_tokens=2, store=False)
    assert r.store is False and r.status in ("completed", "incomplete")
    not_found(http.get(f"/v1/responses/{r.id}"), r.id)
    not_found(http.get(f"/v1/responses/{r.id}/input_items"), r.id)
    not_found(http.delete(f"/v1/responses/{r.id}"), r.id)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=model, input="More", previous_response_id=r.id)


def test_deleted_response_is_gone(client: openai.OpenAI, http: httpx.Client,
                                  model: str) -> None:
    r = client.responses.create(model=model, input="Hi", max_output_tokens=2)
    assert http.get(f"/v1/responses/{r.id}").status_code == 200
    assert http.delete(f"/v1/responses/{r.id}").json()["deleted"] is True
    not_found(http.get(f"/v1/responses/{r.id}"), r.id)
    not_found(http.delete(f"/v1/responses/{r.id}"), r.id)  # once only
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=model, input="More", previous_response_id=r.id)


@pytest.mark.parametrize(("path", "params", "param"), [
    ("", {"stream": "true"}, "stream"),
    ("", {"starting_after": "3"}, "starting_after"),
    ("", {"include": "message.output_text.logprobs"}, "include"),
    ("/input_items", {"include": "message.output_text.logprobs"}, "include"),
    ("/input_items", {"after": "msg_unknown"}, "after"),
    ("/input_items", {"limit": "0"}, "limit"),
    ("/input_items", {"limit": "101"}, "limit"),
    ("/input_items", {"order": "newest"}, "order"),
])
def test_unsupported_or_bad_query_is_400(client: openai.OpenAI, http: httpx.Client, model: str,
                                         path: str, params: dict[str, str], param: str) -> None:
    r = client.responses.create(model=model, input="Hi", max_output_tokens=2)
    bad = http.get(f"/v1/responses/{r.id}{path}", params=params)
    assert bad.status_code == 400, bad.text
    error = bad.json()["error"]
    assert error["type"] == "BadRequestError" and param in (error["param"] or "")
    assert http.get(f"/v1/responses/{r.id}{path}").status_code == 200  # the rest was fine
