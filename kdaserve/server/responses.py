"""/v1/responses, OpenAI's Responses API (what the Agents SDK and newer clients call), on top
of the chat path: the input items become chat messages, the chat template and the template
family's output parser do the rest, and the parsed events become output items (reasoning,
message, function_call), whole or as the Responses stream events.

`previous_response_id` continues a stored conversation: each stored response keeps its
messages (its input without `instructions`, which OpenAI does not carry over, plus its
output) in the bounded in-memory store of response_store.py, which also serves the stored
responses' GET, DELETE and input_items routes.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field

from kdaserve.client.request_client import EngineError
from kdaserve.server.chat import ChatPlan, chat_handler
from kdaserve.server.chat_template import image_parts
from kdaserve.server.k3_parser import Event
from kdaserve.server.protocol import ChatCompletionRequest, Seed, Strict
from kdaserve.server.response_store import (
    ResponseStore,
    StoredResponse,
    input_items,
)
from kdaserve.server.serving import (
    ServerState,
    admit,
    check_model,
    first_then_rest,
    off_loop,
    sse,
    timed,
)
from kdaserve.server.tool_parser import ToolCallDelta

__all__ = ["ResponseStore", "ResponsesRequest", "create_response"]  # the store: for launch.py


class ResponsesRequest(Strict):
    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, lt=2**31)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: Seed | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | ...}}
    reasoning: dict[str, Any] | None = None  # {"effort": ...}
    previous_response_id: str | None = None
    stream: bool = False
    store: bool = True
    truncation: Literal["disabled"] | None = None
    include: Annotated[list[str], Field(max_length=0)] | None = None  # nothing extra
    # advisory: accepted, ignored
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


def _content_of(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A Responses message's content as chat content: its text, or where it has images the
    chat parts (text and image_url)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of parts")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "input_image":
            if part.get("file_id") is not None:
                raise ValueError(f"{at}.file_id is not supported (this server has no Files "
                                 "API): give image_url, a data: or http(s) URL")
            if not isinstance(part.get("image_url"), str):
                raise ValueError(f"{at}.image_url must be a URL string")
            image = {"url": part["image_url"]}
            if part.get("detail") is not None:
                image["detail"] = part["detail"]  # checked with the chat request's
            parts.append({"type": "image_url", "image_url": image})
            continue
        if kind not in ("input_text", "output_text", "text"):
            raise ValueError(f"{at}: only text and input_image parts are supported, got "
                             f"{kind!r}")
        if not isinstance(part.get("text", ""), str):
            raise ValueError(f"{at}.text must be a string")
        parts.append({"type": "text", "text": part.get("text", "")})
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _text_of(content: Any, where: str) -> str:
    text = _content_of(content, where)
    if not isinstance(text, str):
        raise ValueError(f"{where}: images go in messages, not here")
    return text


def to_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items -> chat messages (function calls merge into one assistant turn;
    a reasoning item becomes the next assistant turn's reasoning_content)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ValueError(f"{where}.role must be user, system, developer or assistant")
            msg = {"role": "system" if role == "developer" else role,
                   "content": _content_of(item.get("content"), where)}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            messages.append(msg)
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if not all(isinstance(v, str) for v in (call["id"], item.get("name"),
                                                    item.get("arguments"))):
                raise ValueError(f"{where}: a function_call needs call_id, name and arguments "
                                 "strings")
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                msg = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    msg["reasoning_content"], reasoning = reasoning, None
                messages.append(msg)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ValueError(f"{where}: a function_call_output needs a call_id")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text_of(item.get("output"), where)})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise ValueError(f"{where}.type {kind!r} is not supported (message, "
                             "function_call, function_call_output, reasoning)")
    return messages


def to_chat(req: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    tools = None
    if req.tools is not None:
        tools = []
        for i, t in enumerate(req.tools):
            if t.get("type") != "function":
                raise ValueError(f"tools[{i}].type {t.get('type')!r} is not supported (only "
                                 "function tools)")
            fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
            tools.append({"type": "function", "function": fn})
    choice: Any = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ValueError("tool_choice must be none, auto, required or "
                             "{type: function, name}")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    fmt = (req.text or {}).get("format")
    response_format = None
    if fmt is not None and not isinstance(fmt, dict):
        raise ValueError("text.format must be an object such as {\"type\": \"text\"}")
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_schema":
            response_format = {"type": "json_schema", "json_schema": {
                k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
        else:
            response_format = {"type": kind}
    effort = (req.reasoning or {}).get("effort")
    return ChatCompletionRequest.model_validate({
        "model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed, "tools": tools,
        "tool_choice": choice, "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": response_format, "reasoning_effort": effort})


class Builder:
    """Parsed chat events -> Responses output items, and the stream events on the way."""

    def __init__(self, head: dict[str, Any], parallel_calls: bool) -> None:
        self.head, self.parallel_calls = head, parallel_calls
        self.items: list[dict[str, Any]] = []
        self.seq = 0
        self.open: dict[str, Any] | None = None  # the item being written
        self.calls: dict[int, dict[str, Any]] = {}

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """A snapshot: items keep growing after their events went out."""
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **copy.deepcopy(fields)}

    def _start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        out = self.close()
        self.open = item
        self.items.append(item)
        idx = len(self.items) - 1
        out.append(self.event("response.output_item.added", output_index=idx,
                               item={**item, "status": "in_progress"}))
        if item["type"] in ("message", "reasoning"):
            part = {"type": "output_text" if item["type"] == "message" else "reasoning_text",
                    "text": ""}
            if item["type"] == "message":
                part["annotations"] = []
            item["content"].append(part)
            out.append(self.event("response.content_part.added", item_id=item["id"],
                                   output_index=idx, content_index=0, part=dict(part)))
        return out

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        idx = self.items.index(item)
        out = []
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            extra = {"logprobs": []} if kind == "output_text" else {}
            out.append(self.event(f"response.{kind}.done", item_id=item["id"],
                                  output_index=idx, content_index=0, text=part["text"],
                                  **extra))
            out.append(self.event("response.content_part.done", item_id=item["id"],
                                   output_index=idx, content_index=0, part=part))
        else:
            out.append(self.event("response.function_call_arguments.done",
                                   item_id=item["id"], output_index=idx, name=item["name"],
                                   arguments=item["arguments"]))
        item["status"] = status
        out.append(self.event("response.output_item.done", output_index=idx, item=item))
        return out

    def feed(self, events: list[Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for ev in events:
            if isinstance(ev, ToolCallDelta):
                if ev.index > 0 and not self.parallel_calls:
                    continue
                item = self.calls.get(ev.index)
                if item is None:
                    item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}",
                            "call_id": ev.id or f"call_{uuid.uuid4().hex}",
                            "name": ev.name or "", "arguments": ""}
                    self.calls[ev.index] = item
                    out += self._start(item)
                item["arguments"] += ev.arguments
                if ev.arguments:
                    out.append(self.event("response.function_call_arguments.delta",
                                           item_id=item["id"],
                                           output_index=self.items.index(item),
                                           delta=ev.arguments))
                continue
            kind, text = ev
            if not text:
                continue
            want = "message" if kind == "content" else "reasoning"
            if self.open is None or self.open["type"] != want:
                prefix = "msg" if want == "message" else "rs"
                item = {"type": want, "id": f"{prefix}_{uuid.uuid4().hex}", "content": []}
                if want == "message":
                    item["role"] = "assistant"
                else:
                    item["summary"] = []
                out += self._start(item)
            assert self.open is not None
            self.open["content"][0]["text"] += text
            name = "output_text" if want == "message" else "reasoning_text"
            extra = {"logprobs": []} if want == "message" else {}
            out.append(self.event(f"response.{name}.delta", item_id=self.open["id"],
                                  output_index=len(self.items) - 1, content_index=0,
                                  delta=text, **extra))
        return out

    def response(self, status: str, usage: dict[str, Any] | None = None,
                 reason: str | None = None) -> dict[str, Any]:
        return {**self.head, "status": status, "output": self.items if usage else [],
                "usage": usage, "incomplete_details": {"reason": reason} if reason else None}


def _usage(plan: ChatPlan, output: int, cached: int, reasoning: int) -> dict[str, Any]:
    prompt = len(plan.ids) - plan.pending
    # cache_write_tokens counts what OpenAI's explicit prompt caching bills as written; the
    # prefix cache here is implicit and reports only what a request read from it: nothing
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": min(cached, prompt),
                                     "cache_write_tokens": 0},
            "output_tokens": output + plan.pending,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + output + plan.pending}


def _messages_of(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items -> the assistant turn stored for previous_response_id."""
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in items:
        if item["type"] == "message":
            msg["content"] += item["content"][0]["text"]
        elif item["type"] == "reasoning":
            msg["reasoning_content"] = item["content"][0]["text"]
        else:
            msg.setdefault("tool_calls", []).append({
                "id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}})
    return [msg]


async def create_response(state: ServerState, req: ResponsesRequest) -> Response:
    chat = chat_handler(state)
    previous: StoredResponse | None = None
    if req.previous_response_id:
        if state.responses is None:
            raise ValueError("this server keeps no response store")
        previous = state.responses.previous(req.previous_response_id)
    history = list(previous.messages) if previous is not None else []
    turn = to_messages(req.input)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    creq = to_chat(req, system + history + turn)
    plan = await off_loop(state, bool(image_parts(creq.messages)), chat.plan, creq,
                          state.max_request_tokens, state.media)
    check_model(state, req.model)
    admit(state, 1)
    rid = f"resp_{uuid.uuid4().hex}"
    head = {"id": rid, "object": "response", "created_at": int(time.time()),
            "model": state.model_name, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "tools": req.tools or [], "tool_choice": req.tool_choice
            or "auto", "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "text": req.text or {"format": {"type": "text"}}, "reasoning": req.reasoning,
            "store": req.store, "metadata": req.metadata or {}, "truncation": "disabled",
            "error": None}
    builder = Builder(head, req.parallel_tool_calls)
    parser = chat.format.parser(plan.thinking, plan.use_tools, plan.reasoning)
    stream = timed(state, plan.ids, plan.params, rid, plan.options, plan.images)
    _, rest = await first_then_rest(stream)

    async def run() -> AsyncIterator[dict[str, Any]]:
        yield builder.event("response.created", response=builder.response("in_progress"))
        yield builder.event("response.in_progress", response=builder.response("in_progress"))
        sent = 0
        async for out in rest:
            o = out.outputs[0]
            text = o.text or ""
            events = parser.feed(text[sent:])
            sent = len(text)
            if o.finish_reason is not None:
                events += parser.finish()
            for ev in builder.feed(events):
                yield ev
            if out.finished:
                cut = o.finish_reason == "length"
                for ev in builder.close("incomplete" if cut else "completed"):
                    yield ev
                # the reasoning channel's tokens, counted again from its text
                reasoning = sum(len(chat.tokenizer.encode(i["content"][0]["text"]))
                                for i in builder.items if i["type"] == "reasoning")
                usage = _usage(plan, len(o.token_ids), out.num_cached_tokens, reasoning)
                if o.finish_reason == "length":
                    final = builder.response("incomplete", usage, "max_output_tokens")
                else:
                    final = builder.response("completed", usage)
                if req.store and state.responses is not None:
                    context = [*previous.items, *previous.response["output"]] \
                        if previous is not None else []
                    state.responses.put(rid, StoredResponse(
                        copy.deepcopy(final), context + input_items(req.input),
                        history + turn + _messages_of(builder.items)))
                kind = "response.incomplete" if final["status"] == "incomplete" \
                    else "response.completed"
                yield builder.event(kind, response=final)

    if not req.stream:
        final: dict[str, Any] = {}
        async for ev in run():
            if ev["type"] in ("response.completed", "response.incomplete"):
                final = ev["response"]
        return JSONResponse(final)

    async def body() -> AsyncIterator[str]:
        try:
            async for ev in run():
                yield f"event: {ev['type']}\n" + sse(ev)
        except EngineError as e:
            yield "event: error\n" + sse({"type": "error", "code": str(e.status),
                                          "message": str(e), "param": None,
                                          "sequence_number": builder.seq})
        finally:
            await rest.aclose()  # type: ignore[attr-defined]

    return StreamingResponse(body(), media_type="text/event-stream")
