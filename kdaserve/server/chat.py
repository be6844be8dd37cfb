"""/v1/chat/completions: chat template -> engine -> reasoning split -> kimi_k2 tool calls."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from kdaserve.engine.client import EngineError
from kdaserve.request import CompletionOutput, RequestOutput
from kdaserve.server.chat_template import ChatTemplate, validate_tools
from kdaserve.server.protocol import ChatCompletionRequest
from kdaserve.server.tool_parser import (
    ReasoningParser,
    StreamingToolParser,
    ToolCallDelta,
    parse_tool_calls,
)
from kdaserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    from kdaserve.server.api import ServerState


def chat_logprobs(tok: Tokenizer, ids: list[int], lps: list[dict[int, float]],
                  top: int) -> dict[str, Any]:
    def entry(t: int, lp: float) -> dict[str, Any]:
        s = tok.decode([t], skip_special_tokens=False)
        return {"token": s, "logprob": lp, "bytes": list(tok.decode_bytes([t]))}

    content = []
    for t, lp in zip(ids, lps, strict=True):
        item = entry(t, lp[t])
        ranked = sorted(lp.items(), key=lambda kv: -kv[1])[:top]
        item["top_logprobs"] = [entry(k, v) for k, v in ranked]
        content.append(item)
    return {"content": content}


class ChatHandler:
    def __init__(self, template: ChatTemplate, tokenizer: Tokenizer,
                 reasoning_parser: str | None = None) -> None:
        self.template, self.tokenizer = template, tokenizer
        self.reasoning = reasoning_parser is not None

    @classmethod
    def from_pretrained(cls, path: str | Path, tokenizer: Tokenizer,
                        reasoning_parser: str | None = None) -> ChatHandler:
        return cls(ChatTemplate.from_pretrained(path), tokenizer, reasoning_parser)

    def prompt_ids(self, req: ChatCompletionRequest) -> tuple[list[int], bool]:
        """Renders and tokenizes the conversation; returns (ids, whether tools are active)."""
        if not req.messages:
            raise ValueError("messages must not be empty")
        tools = req.tools
        if tools is not None:
            validate_tools(tools)
        choice = req.tool_choice
        if isinstance(choice, str) and choice not in ("none", "auto", "required"):
            raise ValueError(f"tool_choice must be none, auto, required or a function, "
                             f"got {choice!r}")
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            names = {(t.get("function") or {}).get("name") for t in tools or []}
            if name not in names:
                raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
        if choice == "none":
            tools = None
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        text = self.template.render(messages, tools=tools, add_generation_prompt=True,
                                    **(req.chat_template_kwargs or {}))
        return self.tokenizer.encode(text), bool(tools)

    async def handle(self, state: ServerState, body: Any) -> Response:
        from kdaserve.server.api import check_length, first_then_rest, last, timed

        try:
            req = ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from e
        ids, use_tools = self.prompt_ids(req)
        max_tokens = check_length(state, ids, req.max_tokens if req.max_completion_tokens is None
                                  else req.max_completion_tokens)
        top = req.top_logprobs or 0
        if top and not req.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        params = req.sampling_params(max_tokens, top if req.logprobs else None)
        if use_tools or self.reasoning:
            params.skip_special_tokens = False  # markers must reach the parsers
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        head = {"id": cid, "created": created, "model": state.model_name}
        stream = timed(state, ids, params, cid)
        if not req.stream:
            final = await last(stream)
            choices = [self._choice(o, use_tools, req) for o in final.outputs]
            completion = sum(len(o.token_ids) for o in final.outputs)
            return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                                 "usage": {"prompt_tokens": len(ids),
                                           "completion_tokens": completion,
                                           "total_tokens": len(ids) + completion}})
        _, rest = await first_then_rest(stream)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(self._stream(rest, head, ids, use_tools, req, include_usage),
                                 media_type="text/event-stream")

    def _choice(self, o: CompletionOutput, use_tools: bool,
                req: ChatCompletionRequest) -> dict[str, Any]:
        text = o.text or ""
        reasoning = ""
        if self.reasoning:
            reasoning, text = ReasoningParser().split(text)
        calls = []
        if use_tools:
            text, calls = parse_tool_calls(text)
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls
                                   else None}
        if self.reasoning:
            message["reasoning_content"] = reasoning or None
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
        logprobs = None
        if req.logprobs and o.logprobs is not None:
            logprobs = chat_logprobs(self.tokenizer, o.token_ids, o.logprobs, req.top_logprobs or 0)
        return {"index": o.index, "message": message, "logprobs": logprobs,
                "finish_reason": "tool_calls" if calls and o.finish_reason == "stop"
                else o.finish_reason}

    async def _stream(self, rest: AsyncIterator[RequestOutput], head: dict[str, Any],
                      ids: list[int], use_tools: bool, req: ChatCompletionRequest,
                      include_usage: bool) -> AsyncIterator[str]:
        from kdaserve.server.api import sse, stream_error

        chunk = {**head, "object": "chat.completion.chunk"}
        sent_text: dict[int, int] = {}
        sent_tok: dict[int, int] = {}
        tool_parsers: dict[int, StreamingToolParser] = {}
        reasoners: dict[int, ReasoningParser] = {}
        completion = 0
        try:
            first = True
            async for out in rest:
                for o in out.outputs:
                    i = o.index
                    if first or i not in sent_text:
                        yield sse({**chunk, "choices": [{"index": i, "logprobs": None,
                                   "delta": {"role": "assistant", "content": ""},
                                   "finish_reason": None}]})
                        sent_text.setdefault(i, 0)
                        sent_tok.setdefault(i, 0)
                    text = o.text or ""
                    delta, sent_text[i] = text[sent_text[i]:], len(text)
                    new_ids, lps = o.token_ids[sent_tok[i]:], (o.logprobs or [])[sent_tok[i]:]
                    sent_tok[i] = len(o.token_ids)
                    deltas = self._deltas(i, delta, use_tools, tool_parsers, reasoners,
                                          final=o.finish_reason is not None)
                    logprobs = (chat_logprobs(self.tokenizer, new_ids, lps, req.top_logprobs or 0)
                                if req.logprobs and o.logprobs is not None and new_ids else None)
                    for n, d in enumerate(deltas):
                        yield sse({**chunk, "choices": [{"index": i, "delta": d,
                                   "logprobs": logprobs if n == 0 else None,
                                   "finish_reason": None}]})
                    if not deltas and logprobs:
                        yield sse({**chunk, "choices": [{"index": i, "delta": {},
                                   "logprobs": logprobs, "finish_reason": None}]})
                    if o.finish_reason is not None:
                        called = use_tools and tool_parsers[i].num_calls > 0
                        reason = "tool_calls" if called and o.finish_reason == "stop" \
                            else o.finish_reason
                        completion += len(o.token_ids)
                        yield sse({**chunk, "choices": [{"index": i, "delta": {},
                                   "logprobs": None, "finish_reason": reason}]})
                first = False
            if include_usage:
                yield sse({**chunk, "choices": [], "usage": {
                    "prompt_tokens": len(ids), "completion_tokens": completion,
                    "total_tokens": len(ids) + completion}})
            yield "data: [DONE]\n\n"
        except EngineError as e:
            yield stream_error(e)
        finally:
            await rest.aclose()  # type: ignore[attr-defined]

    def _deltas(self, i: int, delta: str, use_tools: bool,
                tool_parsers: dict[int, StreamingToolParser],
                reasoners: dict[int, ReasoningParser], final: bool) -> list[dict[str, Any]]:
        """Text delta -> OpenAI delta objects (reasoning, content, tool-call pieces)."""
        out: list[dict[str, Any]] = []
        content = delta
        if self.reasoning:
            r = reasoners.setdefault(i, ReasoningParser())
            reasoning, content = r.feed(delta)
            if final:
                more_r, more_c = r.finish()
                reasoning, content = reasoning + more_r, content + more_c
            if reasoning:
                out.append({"reasoning_content": reasoning})
        if not use_tools:
            if content:
                out.append({"content": content})
            return out
        p = tool_parsers.setdefault(i, StreamingToolParser())
        events = p.feed(content) + (p.finish() if final else [])
        for ev in events:
            if isinstance(ev, ToolCallDelta):
                out.append({"tool_calls": [ev.to_openai()]})
            elif ev:
                out.append({"content": ev})
        return out
