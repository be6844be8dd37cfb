"""FastAPI application: OpenAI-compatible and SGLang-native endpoints over an EngineClient.

Prompts are tokenized here (so usage counts and length checks need no engine round trip); the
engine returns token ids and text. Every error is an OpenAI-style error object; errors found
before a stream starts are real HTTP statuses (400/503), since a stream cannot change its status.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kdaserve.engine.client import EngineClient, EngineError
from kdaserve.request import RequestOutput, SamplingParams
from kdaserve.server.chat import ChatHandler
from kdaserve.server.metrics import ServerMetrics
from kdaserve.server.protocol import (
    CompletionRequest,
    GenerateRequest,
    error_body,
)
from kdaserve.tokenizer import Tokenizer


@dataclass
class ServerState:
    client: EngineClient
    tokenizer: Tokenizer
    model_name: str
    model_path: str
    max_request_tokens: int
    metrics: ServerMetrics
    chat: ChatHandler
    api_key: str | None = None


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def stream_error(e: Exception) -> str:
    """The last event of a stream that failed after it started (its HTTP status is already
    sent): an OpenAI-style error object, and no [DONE], so clients see it did not finish."""
    status = e.status if isinstance(e, EngineError) else 500
    return sse(error_body(str(e), status))


async def timed(state: ServerState, prompt_ids: list[int], params: SamplingParams,
                rid: str) -> AsyncIterator[RequestOutput]:
    """The engine stream of one request, recording TTFT / ITL / E2E and finish reasons."""
    start = last = time.perf_counter()
    first = True
    async for out in state.client.generate(prompt_ids, params, rid):
        now = time.perf_counter()
        (state.metrics.ttft if first else state.metrics.itl).observe(now - last)
        first, last = False, now
        if out.finished:
            state.metrics.e2e.observe(now - start)
            for o in out.outputs:
                state.metrics.requests.labels(o.finish_reason or "unknown").inc()
        yield out


async def first_then_rest(gen: AsyncIterator[RequestOutput]) -> tuple[RequestOutput,
                                                                      AsyncIterator[RequestOutput]]:
    """Awaits the first update, so request errors surface as an HTTP status before streaming."""
    first = await gen.__anext__()

    async def chain() -> AsyncIterator[RequestOutput]:
        yield first
        async for item in gen:
            yield item

    return first, chain()


async def until_disconnect(request: Request, work: Any) -> Response:
    """Runs a handler; if the client goes away before a non-streaming answer is ready, cancels
    it, which aborts its engine requests and frees their blocks and slots. (A streaming
    response returns at once; its disconnects end the stream the same way.)"""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.2)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, EngineError):
                await task
            return Response(status_code=499)  # nginx's "client closed request"


class ModelNotFoundError(Exception):
    """A request for a model this server does not serve: HTTP 404, as OpenAI answers."""


def check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name not in (state.model_name, state.model_path):
        raise ModelNotFoundError(f"The model {name!r} does not exist; this server serves "
                                 f"{state.model_name!r}")


def check_length(context: int, prompt_ids: list[int], max_tokens: int | None) -> int:
    """Resolves max_tokens (None: the rest of the `context`) and rejects what cannot fit."""
    room = context - len(prompt_ids)
    if room < 1:
        raise ValueError(f"prompt has {len(prompt_ids)} tokens; the context holds {context}")
    if max_tokens is None:
        return room
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if max_tokens > room:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) "
                         f"exceeds the context of {context} tokens")
    return max_tokens


def token_str(tok: Tokenizer, tid: int) -> str:
    return tok.decode([tid], skip_special_tokens=False)


def completion_logprobs(tok: Tokenizer, ids: list[int],
                        lps: list[dict[int, float]]) -> dict[str, Any]:
    return {"tokens": [token_str(tok, t) for t in ids],
            "token_logprobs": [lp[t] for t, lp in zip(ids, lps, strict=True)],
            "top_logprobs": [{token_str(tok, k): v for k, v in lp.items()} for lp in lps],
            "text_offset": []}


class ApiKeyMiddleware:
    """Bearer-token check on every path but /health and /metrics."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in ("/health", "/metrics"):
            headers = dict(scope.get("headers") or [])
            if headers.get(b"authorization") != self.expected:
                response = JSONResponse(error_body("invalid API key", 401), status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="kdaserve")
    app.state.kd = state

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        param = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        msg = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body')}: "
                        f"{e.get('msg')}" for e in errs)
        return JSONResponse(error_body(msg or "invalid request", 400, param), status_code=400)

    @app.exception_handler(ValueError)
    async def _value(request: Request, exc: ValueError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), 400), status_code=400)

    @app.exception_handler(ModelNotFoundError)
    async def _no_model(request: Request, exc: ModelNotFoundError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), 404, "model"), status_code=404)

    @app.exception_handler(EngineError)
    async def _engine(request: Request, exc: EngineError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), exc.status), status_code=exc.status)

    if state.api_key:
        # a plain ASGI wrapper, not @app.middleware: Starlette's BaseHTTPMiddleware hides
        # client disconnects from the endpoints, which must abort abandoned requests
        app.add_middleware(ApiKeyMiddleware, key=state.api_key)

    @app.get("/health")
    async def health() -> Response:
        dead = getattr(state.client, "dead", None)
        if dead:
            return JSONResponse(error_body(dead, 503), status_code=503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        async for _ in state.client.generate([0], params, f"health-{uuid.uuid4().hex}"):
            pass
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        body = state.metrics.render(await state.client.get_metrics())
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        """Empties the prefix cache (SGLang's endpoint); 400 while requests lock entries."""
        if await state.client.call("flush_cache"):
            return Response("Cache flushed.", status_code=200)
        return JSONResponse(error_body("cache entries in use by running requests were kept",
                                       400), status_code=400)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "kdaserve", "root": state.model_path,
            "max_model_len": state.max_request_tokens}]}

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": state.model_path, "tokenizer_path": state.model_path,
                "is_generation": True, "weight_version": "default"}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await until_disconnect(request, _completions(state, req))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError as e:  # malformed JSON or not UTF-8: say so, as FastAPI does elsewhere
            raise ValueError(f"request body is not valid JSON: {e}") from e
        return await until_disconnect(request, state.chat.handle(state, body))

    @app.post("/generate")
    async def generate(req: GenerateRequest, request: Request) -> Response:
        return await until_disconnect(request, _generate(state, req))

    return app


def _prompts(tok: Tokenizer, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tok.encode(prompt)]
    if not prompt:
        raise ValueError("prompt is empty")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [tok.encode(p) if isinstance(p, str) else list(p) for p in prompt]


async def _completions(state: ServerState, req: CompletionRequest) -> Response:
    prompts = _prompts(state.tokenizer, req.prompt)
    cid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    context = state.max_request_tokens
    params = [req.sampling_params(check_length(context, p, req.max_tokens), req.logprobs)
              for p in prompts]
    check_model(state, req.model)  # after the 400s, as chat
    n = params[0].n
    streams = [timed(state, p, sp, f"{cid}-{i}")
               for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    if not req.stream:
        finals = await asyncio.gather(*(last(s) for s in streams))
        choices = []
        for i, fo in enumerate(finals):
            for o in fo.outputs:
                text = o.text or ""
                if req.echo:
                    text = state.tokenizer.decode(prompts[i]) + text
                choices.append({
                    "index": i * n + o.index, "text": text, "finish_reason": o.finish_reason,
                    "stop_reason": o.stop_reason,
                    "logprobs": completion_logprobs(state.tokenizer, o.token_ids, o.logprobs)
                    if o.logprobs is not None else None})
        usage = _usage(prompts, finals)
        return JSONResponse({"id": cid, "object": "text_completion", "created": created,
                             "model": state.model_name, "choices": choices, "usage": usage})
    firsts = []
    rests = []
    for s in streams:
        f, r = await first_then_rest(s)
        firsts.append(f)
        rests.append(r)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    async def body() -> AsyncIterator[str]:
        queue: asyncio.Queue = asyncio.Queue()
        sent_text: dict[int, int] = {}
        sent_tok: dict[int, int] = {}
        finals: dict[int, RequestOutput] = {}

        async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in gen:
                    await queue.put((i, out))
            except Exception as e:  # e.g. the engine died: end the stream, never wait forever
                await queue.put((i, e))
                return
            await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(rests)]
        done = 0
        try:
            while done < len(tasks):
                i, out = await queue.get()
                if isinstance(out, Exception):
                    yield stream_error(out)
                    return
                if out is None:
                    done += 1
                    continue
                finals[i] = out
                for o in out.outputs:
                    idx = i * n + o.index
                    text = o.text or ""
                    delta = text[sent_text.get(idx, 0):]
                    new_ids = o.token_ids[sent_tok.get(idx, 0):]
                    lps = None
                    if o.logprobs is not None:
                        lps = completion_logprobs(state.tokenizer, new_ids,
                                                  o.logprobs[sent_tok.get(idx, 0):])
                    if not delta and not o.finish_reason and not new_ids:
                        continue
                    sent_text[idx] = len(text)
                    sent_tok[idx] = len(o.token_ids)
                    yield sse({"id": cid, "object": "text_completion", "created": created,
                               "model": state.model_name,
                               "choices": [{"index": idx, "text": delta, "logprobs": lps,
                                            "finish_reason": o.finish_reason,
                                            "stop_reason": o.stop_reason}]})
            if include_usage:
                yield sse({"id": cid, "object": "text_completion", "created": created,
                           "model": state.model_name, "choices": [],
                           "usage": _usage(prompts, [finals[i] for i in sorted(finals)])})
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            for r in rests:
                await r.aclose()

    return StreamingResponse(body(), media_type="text/event-stream")


async def last(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = None
    async for out in gen:
        final = out
    assert final is not None
    return final


def _usage(prompts: list[list[int]], finals: list[RequestOutput]) -> dict[str, int]:
    # as OpenAI and vLLM count: each prompt once, whatever n
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(len(o.token_ids) for f in finals for o in f.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def _meta(tok: Tokenizer, rid: str, prompt_len: int, o: Any,
          return_logprob: bool) -> dict[str, Any]:
    reason: dict[str, Any] | None = None
    if o.finish_reason == "length":
        reason = {"type": "length", "length": len(o.token_ids)}
    elif o.finish_reason == "stop":
        reason = {"type": "stop", "matched": o.stop_reason}
    elif o.finish_reason == "abort":
        reason = {"type": "abort", "message": "aborted"}
    meta: dict[str, Any] = {"id": rid, "finish_reason": reason, "prompt_tokens": prompt_len,
                            "completion_tokens": len(o.token_ids), "cached_tokens": 0}
    if return_logprob and o.logprobs is not None:
        meta["output_token_logprobs"] = [[lp[t], t, token_str(tok, t)]
                                         for t, lp in zip(o.token_ids, o.logprobs, strict=True)]
        meta["output_top_logprobs"] = [[[v, k, token_str(tok, k)] for k, v in lp.items()]
                                       for lp in o.logprobs]
    return meta


async def _generate(state: ServerState, req: GenerateRequest) -> Response:
    """SGLang-native /generate (what bench_sglang.py and RL trainers call)."""
    if (req.text is None) == (req.input_ids is None):
        raise ValueError("exactly one of text or input_ids is required")
    single = isinstance(req.text, str) or (
        req.input_ids is not None and all(isinstance(x, int) for x in req.input_ids))
    if req.text is not None:
        texts = [req.text] if isinstance(req.text, str) else req.text
        prompts = [state.tokenizer.encode(t) for t in texts]
    else:
        prompts = [req.input_ids] if single else list(req.input_ids)  # type: ignore[list-item]
    logprobs = max(req.top_logprobs_num, 0) if req.return_logprob else None
    # max_new_tokens 0 (SGLang's prefix-cache warm-up): prefill only, report no output
    prefill_only = req.sampling_params.max_new_tokens == 0
    if prefill_only:
        req.sampling_params.max_new_tokens = 1
    params = req.sampling_params.to_params(logprobs)
    for p in prompts:
        check_length(state.max_request_tokens, p, params.max_tokens)
    base = req.rid or uuid.uuid4().hex
    rids = [base if single else f"{base}-{i}" for i in range(len(prompts))]
    if req.stream:
        if not single:
            raise ValueError("streaming /generate takes one prompt")
        first, rest = await first_then_rest(timed(state, prompts[0], params, rids[0]))

        async def body() -> AsyncIterator[str]:
            try:
                async for out in rest:
                    o = out.outputs[0]
                    yield sse({"text": o.text or "", "output_ids": o.token_ids,
                               "meta_info": _meta(state.tokenizer, rids[0], len(prompts[0]), o,
                                                  req.return_logprob)})
                yield "data: [DONE]\n\n"
            except EngineError as e:
                yield stream_error(e)
            finally:
                await rest.aclose()

        return StreamingResponse(body(), media_type="text/event-stream")
    finals = await asyncio.gather(*(last(timed(state, p, params, r))
                                    for p, r in zip(prompts, rids, strict=True)))
    if prefill_only:
        for f in finals:
            for o in f.outputs:
                o.token_ids, o.text, o.logprobs = [], "", [] if o.logprobs is not None else None
                o.finish_reason, o.stop_reason = "length", None
    results = [{"text": o.text or "", "output_ids": o.token_ids,
                "meta_info": _meta(state.tokenizer, f.rid, len(p), o, req.return_logprob)}
               for f, p in zip(finals, prompts, strict=True) for o in f.outputs]
    return JSONResponse(results[0] if single and params.n == 1 else results)
