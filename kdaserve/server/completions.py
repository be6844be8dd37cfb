"""/v1/completions: one or many prompts, n choices each, whole or streamed; `echo` returns the
prompt in front of the text, and with `logprobs` the prompt tokens' log-probabilities too
(lm-eval-harness scores multiple-choice items that way: `echo`, `max_tokens` 0 or 1)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from kdaserve.request import RequestOutput
from kdaserve.server.protocol import CompletionRequest, check_sequences
from kdaserve.server.serving import (
    ServerState,
    admit,
    all_finals,
    check_length,
    check_model,
    first_then_rest,
    sse,
    stream_error,
    timed,
    usage,
)
from kdaserve.tokenizer import Tokenizer


def prompt_ids(tok: Tokenizer, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tok.encode(prompt)]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [tok.encode(p) if isinstance(p, str) else list(p) for p in prompt]


@dataclass
class Logprobs:
    """OpenAI's legacy completion logprobs, built token by token: text_offset counts the
    characters of the choice's text before each token (UTF-8 lead bytes, so a character
    split over tokens counts once)."""

    tok: Tokenizer
    top: int
    offset: int = 0
    echoed: bool = False  # the prompt went out (with echo, in front of the first text)

    def build(self, ids: list[int], lps: list[dict[int, float] | None],
              skip_special: bool) -> dict[str, Any]:
        """`skip_special`: as the text was decoded (special tokens then take no room)."""
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
        for t, lp in zip(ids, lps, strict=True):
            raw = self.tok.decode_bytes([t])
            out["tokens"].append(raw.decode("utf-8", errors="replace"))
            out["text_offset"].append(self.offset)
            shown = self.tok.decode_bytes([t], skip_special_tokens=skip_special)
            self.offset += sum((b & 0xC0) != 0x80 for b in shown)
            if lp is None:  # the first prompt token: nothing predicts it
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(lp[t])
            best = sorted(lp.items(), key=lambda kv: -kv[1])[:self.top]
            out["top_logprobs"].append({self.tok.decode([k]): v for k, v in [*best, (t, lp[t])]})
        return out


async def create_completion(state: ServerState, req: CompletionRequest) -> Response:
    tok = state.need_tokenizer("/v1/completions")
    # off the event loop: a 10 MB prompt takes a second to tokenize
    prompts = await asyncio.to_thread(prompt_ids, tok, req.prompt)
    check_sequences(len(prompts), req.n or 1)
    if req.bootstrap_room is not None and (len(prompts) > 1 or (req.echo and req.logprobs)):
        raise ValueError("a disaggregated request (bootstrap_room) takes one prompt and no "
                         "prompt logprobs (the prefill server computes them: /generate with "
                         "return_logprob, whose input logprobs the PD router merges)")
    cid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    score_only = req.max_tokens == 0
    if score_only and not req.echo:
        raise ValueError("max_tokens 0 needs echo: true (scoring the prompt)")
    # scoring the prompt: one token is generated and dropped, as SGLang's max_new_tokens 0
    max_tokens = 1 if score_only else req.max_tokens
    extra: dict[str, Any] = {}
    if req.echo and req.logprobs is not None:
        extra = {"prompt_logprobs": req.logprobs, "logprob_start_len": 0}
    params = [state.sampling.params(
        req.sampling_fields(check_length(state.max_request_tokens, p, max_tokens)),
        logprobs=req.logprobs, **extra) for p in prompts]
    options = req.options()
    check_model(state, req.model)  # after the 400s, as chat
    n = params[0].n
    admit(state, len(prompts) * n)
    streams = [timed(state, p, sp, f"{cid}-{i}", options)
               for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    head = {"id": cid, "object": "text_completion", "created": created,
            "model": state.model_name}
    if not req.stream:
        finals = await all_finals(streams)
        choices = []
        for i, fo in enumerate(finals):
            for o in fo.outputs:
                if score_only:
                    o.token_ids, o.text, o.finish_reason = [], "", "length"
                    o.logprobs = [] if o.logprobs is not None else None
                text, logprobs = _choice_text(tok, req, prompts[i], fo, o.token_ids,
                                              o.text or "", o.logprobs,
                                              Logprobs(tok, req.logprobs or 0))
                choices.append({"index": i * n + o.index, "text": text,
                                "finish_reason": o.finish_reason,
                                "stop_reason": o.stop_reason, "logprobs": logprobs})
        return JSONResponse({**head, "choices": choices, "usage": _usage(prompts, finals)})
    if score_only:
        raise ValueError("max_tokens 0 (scoring the prompt) cannot stream")
    rests = []
    try:
        for s in streams:
            rests.append((await first_then_rest(s))[1])
    except BaseException:  # one failed before streaming: abort the ones already running
        for r in rests:
            await r.aclose()  # type: ignore[attr-defined]
        for s in streams:  # closing a chain does not close the stream it wraps
            await s.aclose()  # type: ignore[attr-defined]
        raise
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return StreamingResponse(_stream(state, req, prompts, rests, head, n, include_usage),
                             media_type="text/event-stream")


def _choice_text(tok: Tokenizer, req: CompletionRequest, prompt: list[int],
                 out: RequestOutput, ids: list[int], text: str,
                 lps: list[dict[int, float]] | None,
                 builder: Logprobs) -> tuple[str, dict[str, Any] | None]:
    """A choice's text (after the prompt's, with echo) and its logprobs."""
    logprobs = None
    if req.echo and not builder.echoed:
        builder.echoed = True
        if lps is not None:
            assert out.prompt_logprobs is not None
            logprobs = builder.build(prompt, out.prompt_logprobs, False)
        else:
            builder.offset = len(tok.decode_bytes(prompt).decode("utf-8", errors="replace"))
        text = tok.decode(prompt) + text
    if lps is not None:
        tail = builder.build(ids, list(lps), req.skip_special_tokens)
        logprobs = tail if logprobs is None else {k: logprobs[k] + tail[k] for k in tail}
    return text, logprobs


async def _stream(state: ServerState, req: CompletionRequest, prompts: list[list[int]],
                  rests: list[AsyncIterator[RequestOutput]], head: dict[str, Any], n: int,
                  include_usage: bool) -> AsyncIterator[str]:
    tok = state.tokenizer
    assert tok is not None
    queue: asyncio.Queue = asyncio.Queue()
    sent_text: dict[int, int] = {}
    sent_tok: dict[int, int] = {}
    builders: dict[int, Logprobs] = {}
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
                start = sent_tok.get(idx, 0)
                delta, new_ids = text[sent_text.get(idx, 0):], o.token_ids[start:]
                if not delta and not o.finish_reason and not new_ids:
                    continue
                builder = builders.setdefault(idx, Logprobs(tok, req.logprobs or 0))
                lps = o.logprobs[start:] if o.logprobs is not None else None
                delta, logprobs = _choice_text(tok, req, prompts[i], out, new_ids, delta, lps,
                                               builder)
                sent_text[idx], sent_tok[idx] = len(text), len(o.token_ids)
                yield sse({**head, "choices": [{"index": idx, "text": delta,
                                                "logprobs": logprobs,
                                                "finish_reason": o.finish_reason,
                                                "stop_reason": o.stop_reason}]})
        if include_usage:
            yield sse({**head, "choices": [],
                       "usage": _usage(prompts, [finals[i] for i in sorted(finals)])})
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # off the generators first
        for r in rests:
            await r.aclose()  # type: ignore[attr-defined]


def _usage(prompts: list[list[int]], finals: list[RequestOutput]) -> dict[str, Any]:
    # as OpenAI and vLLM count: each prompt once, whatever n
    completion = sum(len(o.token_ids) for f in finals for o in f.outputs)
    return usage(sum(len(p) for p in prompts), completion,
                 sum(min(f.num_cached_tokens, len(p)) for f, p in zip(finals, prompts,
                                                                    strict=True)))
