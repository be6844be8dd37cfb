"""/v1/chat/completions: validate -> chat template -> engine (with a grammar for forced tool
calls and JSON responses, a reasoning budget for thinking requests) -> the template family's
output parser (reasoning, content, tool calls), whole or streamed."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from kdaserve.client.request_client import EngineError
from kdaserve.multimodal import ImageInputs
from kdaserve.request import (
    CompletionOutput,
    Grammar,
    RequestOptions,
    RequestOutput,
    SamplingParams,
)
from kdaserve.server.chat_format import ChatFormat, K3Format, detect_format
from kdaserve.server.chat_request import (
    REASONING_SHARE,
    check_template_kwargs,
    check_tools,
    check_unique,
    dynamic_tools,
    parse_response_format,
    resolve_thinking,
    resolve_tool_choice,
)
from kdaserve.server.chat_template import ChatTemplate, image_parts
from kdaserve.server.k3_parser import Event
from kdaserve.server.k3_render import CONTROL_TOKENS as K3_CONTROL_TOKENS
from kdaserve.server.k3_render import K3Renderer, is_kimi_k3
from kdaserve.server.media import MediaLoader
from kdaserve.server.protocol import ChatCompletionRequest
from kdaserve.server.sampling import Sampling
from kdaserve.server.sampling_policy import SamplingPolicy
from kdaserve.server.serving import (
    ServerState,
    admit,
    check_length,
    check_model,
    first_then_rest,
    last,
    off_loop,
    sse,
    stream_error,
    timed,
    usage,
)
from kdaserve.server.tool_parser import ToolCallDelta
from kdaserve.tokenizer import Tokenizer


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


@dataclass
class ChatPlan:
    """A validated chat request, ready for the engine."""

    ids: list[int]
    params: SamplingParams
    options: RequestOptions
    pending: int  # trailing prompt tokens counted as output (the channel opener)
    thinking: bool  # output starts in the reasoning channel
    use_tools: bool  # parse tool calls out of the output
    reasoning: bool  # report reasoning_content
    images: ImageInputs | None = None  # the images in `ids`, processed

    def usage(self, completion: int, cached: int) -> dict[str, Any]:
        prompt = len(self.ids) - self.pending
        return usage(prompt, completion + self.pending * self.params.n, min(cached, prompt))


def delta_of(ev: Event) -> dict[str, Any]:
    if isinstance(ev, ToolCallDelta):
        return {"tool_calls": [ev.to_openai()]}
    kind, text = ev
    return {"reasoning_content" if kind == "reasoning" else "content": text}


def chat_handler(state: ServerState) -> ChatHandler:
    """The server's chat handler (a ValueError, HTTP 400, when it runs without a tokenizer)."""
    state.need_tokenizer("chat")
    assert isinstance(state.chat, ChatHandler)
    return state.chat


class ChatHandler:
    def __init__(self, template: ChatTemplate | K3Renderer, tokenizer: Tokenizer,
                 reasoning_parser: str | None = None, policy: SamplingPolicy | None = None,
                 default_max_tokens: int | None = None,
                 tool_call_parser: str | None = None) -> None:
        self.template, self.tokenizer = template, tokenizer
        self.format: ChatFormat = K3Format() if isinstance(template, K3Renderer) \
            else detect_format(template.source)
        # SGLang's and vLLM's flags name the parser; ours is the chat format's, so a flag
        # naming the other format's would parse every answer wrong: refused at start-up
        for flag, parser in (("--reasoning-parser", reasoning_parser),
                             ("--tool-call-parser", tool_call_parser)):
            if parser is not None and parser != self.format.name:
                raise ValueError(f"{flag} {parser}: this checkpoint's chat format is "
                                 f"{self.format.name} ({template.origin})")
        # K3 always separates its channels; K2 splits <think> only when asked
        self.reasoning = reasoning_parser is not None or isinstance(self.format, K3Format)
        # the server's one way to SamplingParams; a raw prompt takes this format's default mode
        self.sampling = Sampling(policy, self.format.default_thinking)
        self.default_max_tokens = default_max_tokens

    @classmethod
    def from_pretrained(cls, path: str | Path, tokenizer: Tokenizer,
                        reasoning_parser: str | None = None,
                        template_file: str | Path | None = None,
                        policy: SamplingPolicy | None = None,
                        default_max_tokens: int | None = None,
                        tool_call_parser: str | None = None) -> ChatHandler:
        template: ChatTemplate | K3Renderer
        if template_file is not None:
            template = ChatTemplate(Path(template_file).read_text(encoding="utf-8"),
                                    str(template_file))
        else:
            template = ChatTemplate.from_pretrained(path)
            # K3 ships no template: its own renderer, where the tokenizer has its tags
            if template.origin == "builtin" and is_kimi_k3(path) and all(
                    t in tokenizer.special_tokens for t in K3_CONTROL_TOKENS):
                template = K3Renderer()
        return cls(template, tokenizer, reasoning_parser, policy, default_max_tokens,
                   tool_call_parser)

    def render(self, messages: list[dict[str, Any]], media: MediaLoader | None,
               tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
               *, room: int | None = None, **kwargs: Any) -> tuple[list[int], ImageInputs | None]:
        """The prompt's ids with each image's prompt in place (`media` loads and processes
        them, the prompt within `room` tokens; None: the server takes no images)."""
        tok = self.tokenizer
        where = {id(part): at for at, part in image_parts(messages)}
        if where:  # why images cannot be taken, before any is loaded
            first = next(iter(where.values()))
            if media is None or media.refusal is not None:
                why = "this server takes no images" if media is None else media.refusal
                raise ValueError(f"{first}: {why}")
        if not isinstance(self.template, K3Renderer):
            return self.template.render_ids(tok, messages, tools=tools,
                                            add_generation_prompt=add_generation_prompt,
                                            **kwargs)[1], None
        _, ids, parts = self.template.render_with_images(
            tok, messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
        if not parts:
            return ids, None
        assert media is not None
        return media.prepare(ids, [(where[id(p)], p["image_url"]["url"]) for p in parts],
                             room=room)

    def plan(self, req: ChatCompletionRequest, room: int,
             media: MediaLoader | None = None) -> ChatPlan:
        """Validates and renders `req`; `room`: the context left for prompt + output."""
        if not req.messages:
            raise ValueError("messages must not be empty")
        fmt, tok = self.format, self.tokenizer
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        dynamic = dynamic_tools(messages)
        tools = check_tools(req.tools, "tools") if req.tools is not None else None
        everything = (tools or []) + dynamic
        check_unique(everything)
        choice = resolve_tool_choice(req.tool_choice, everything)
        response_format = parse_response_format(req.response_format)
        forced = choice == "required" or isinstance(choice, dict)
        if forced and response_format.kind != "text":
            raise ValueError("response_format json cannot be combined with a forced tool call "
                             "(tool_choice required or a named function)")
        kwargs = check_template_kwargs(req.chat_template_kwargs)
        thinking, effort = resolve_thinking(req.thinking, req.reasoning_effort, kwargs,
                                            fmt.default_thinking)
        kwargs["thinking"] = thinking
        if effort is not None:
            kwargs["thinking_effort"] = effort
        if isinstance(req.tool_choice, str):  # as sent: the template words each choice
            kwargs["tool_choice"] = req.tool_choice
        if req.response_format is not None:
            kwargs["response_format"] = req.response_format
        ids, images = self.render(messages, media, tools or None, room=room, **kwargs)
        max_tokens = req.max_tokens if req.max_completion_tokens is None \
            else req.max_completion_tokens
        if max_tokens is None and self.default_max_tokens is not None:
            max_tokens = min(self.default_max_tokens, max(room - len(ids), 1))
        max_tokens = check_length(room, ids, max_tokens)
        top = req.top_logprobs or 0
        if top and not req.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        fields = req.sampling_fields(max_tokens)
        reasons = isinstance(fmt, K3Format) and thinking  # the output opens in `think`
        grammar = self._grammar(choice, everything, response_format, reasons)
        if grammar is not None:
            if fields["grammar"] is not None:
                raise ValueError("regex, json_schema and ebnf cannot be combined with tools or "
                                 "response_format: both would constrain the answer")
            fields["grammar"] = grammar
        extra: dict[str, Any] = {"keep_special_ids": fmt.marker_ids(tok)}
        if reasons:
            extra["reasoning_end"] = fmt.reasoning_end(tok)
            extra["reasoning_budget"] = max(1, int(REASONING_SHARE[effort or "max"]
                                                   * max_tokens))
        params = self.sampling.params(fields, thinking, logprobs=top if req.logprobs else None,
                                      **extra)
        use_tools = bool(everything) and choice != "none"
        return ChatPlan(ids, params, req.options(), fmt.pending_tokens(thinking), reasons,
                        use_tools, self.reasoning, images)

    def _grammar(self, choice: str | dict[str, Any], tools: list[dict[str, Any]],
                 response_format: Any, thinking: bool) -> Grammar | None:
        if isinstance(choice, dict):
            name = choice["function"]["name"]
            return self.format.tool_grammar([t for t in tools if t["function"]["name"] == name],
                                            thinking)
        if choice == "required":
            return self.format.tool_grammar(tools, thinking)
        strict = [bool(t["function"].get("strict", t.get("strict"))) for t in tools]
        if choice == "auto" and any(strict):  # a call, if the model makes one, must validate
            loose = [t if s else {"type": "function", "function": {
                "name": t["function"]["name"]}} for t, s in zip(tools, strict, strict=True)]
            return self.format.tool_grammar(loose, thinking, optional=True)
        if response_format.kind == "json_object":
            return self.format.json_grammar(None, thinking)
        if response_format.kind == "json_schema":
            return self.format.json_grammar(response_format.schema, thinking)
        return None

    async def handle(self, state: ServerState, body: ChatCompletionRequest | Any) -> Response:
        try:
            req = ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from e
        # off the event loop: rendering and tokenizing a long conversation takes a while
        plan = await off_loop(state, bool(image_parts(req.messages)), self.plan, req,
                              state.max_request_tokens, state.media)
        check_model(state, req.model)
        admit(state, plan.params.n)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        head = {"id": cid, "created": int(time.time()), "model": state.model_name}
        stream = timed(state, plan.ids, plan.params, cid, plan.options, plan.images)
        if not req.stream:
            final = await last(stream)
            choices = [self._choice(o, plan, req) for o in final.outputs]
            completion = sum(len(o.token_ids) for o in final.outputs)
            return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                                 "usage": plan.usage(completion, final.num_cached_tokens)})
        _, rest = await first_then_rest(stream)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(self._stream(rest, head, plan, req, include_usage),
                                 media_type="text/event-stream")

    def _choice(self, o: CompletionOutput, plan: ChatPlan,
                req: ChatCompletionRequest) -> dict[str, Any]:
        parser = self.format.parser(plan.thinking, plan.use_tools, plan.reasoning)
        events = parser.feed(o.text or "") + parser.finish()
        reasoning = "".join(e[1] for e in events if isinstance(e, tuple) and e[0] == "reasoning")
        content = "".join(e[1] for e in events if isinstance(e, tuple) and e[0] == "content")
        calls: dict[int, dict[str, Any]] = {}
        for e in events:
            if isinstance(e, ToolCallDelta):
                call = calls.setdefault(e.index, {"id": e.id, "type": "function",
                                                  "function": {"name": e.name,
                                                               "arguments": ""}})
                call["function"]["arguments"] += e.arguments
        message: dict[str, Any] = {"role": "assistant",
                                   "content": content or None if calls else content}
        if plan.reasoning:
            message["reasoning_content"] = reasoning or None
        if calls:
            message["tool_calls"] = [calls[i] for i in sorted(calls)]
            if not req.parallel_tool_calls:
                del message["tool_calls"][1:]
        logprobs = None
        if req.logprobs and o.logprobs is not None:
            logprobs = chat_logprobs(self.tokenizer, o.token_ids, o.logprobs, req.top_logprobs or 0)
        return {"index": o.index, "message": message, "logprobs": logprobs,
                "finish_reason": "tool_calls" if calls and o.finish_reason == "stop"
                else o.finish_reason}

    async def _stream(self, rest: AsyncIterator[RequestOutput], head: dict[str, Any],
                      plan: ChatPlan, req: ChatCompletionRequest,
                      include_usage: bool) -> AsyncIterator[str]:
        chunk = {**head, "object": "chat.completion.chunk"}
        sent_text: dict[int, int] = {}
        sent_tok: dict[int, int] = {}
        parsers: dict[int, Any] = {}
        called: set[int] = set()
        completion = cached = 0
        try:
            async for out in rest:
                cached = out.num_cached_tokens
                for o in out.outputs:
                    i = o.index
                    if i not in sent_text:
                        yield sse({**chunk, "choices": [{"index": i, "logprobs": None,
                                   "delta": {"role": "assistant", "content": ""},
                                   "finish_reason": None}]})
                        sent_text[i] = sent_tok[i] = 0
                        parsers[i] = self.format.parser(plan.thinking, plan.use_tools,
                                                         plan.reasoning)
                    text = o.text or ""
                    delta, sent_text[i] = text[sent_text[i]:], len(text)
                    new_ids, lps = o.token_ids[sent_tok[i]:], (o.logprobs or [])[sent_tok[i]:]
                    sent_tok[i] = len(o.token_ids)
                    events = parsers[i].feed(delta)
                    if o.finish_reason is not None:
                        events += parsers[i].finish()
                    if not req.parallel_tool_calls:  # the first call only
                        events = [e for e in events
                                  if not (isinstance(e, ToolCallDelta) and e.index > 0)]
                    if any(isinstance(e, ToolCallDelta) for e in events):
                        called.add(i)
                    logprobs = (chat_logprobs(self.tokenizer, new_ids, lps, req.top_logprobs or 0)
                                if req.logprobs and o.logprobs is not None and new_ids else None)
                    for n, ev in enumerate(events):
                        yield sse({**chunk, "choices": [{"index": i, "delta": delta_of(ev),
                                   "logprobs": logprobs if n == 0 else None,
                                   "finish_reason": None}]})
                    if not events and logprobs:
                        yield sse({**chunk, "choices": [{"index": i, "delta": {},
                                   "logprobs": logprobs, "finish_reason": None}]})
                    if o.finish_reason is not None:
                        reason = "tool_calls" if i in called and o.finish_reason == "stop" \
                            else o.finish_reason
                        completion += len(o.token_ids)
                        yield sse({**chunk, "choices": [{"index": i, "delta": {},
                                   "logprobs": None, "finish_reason": reason}]})
            if include_usage:
                yield sse({**chunk, "choices": [], "usage": plan.usage(completion, cached)})
            yield "data: [DONE]\n\n"
        except EngineError as e:
            yield stream_error(e)
        finally:
            await rest.aclose()  # type: ignore[attr-defined]

