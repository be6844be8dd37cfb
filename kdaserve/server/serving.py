"""What every endpoint shares: the server's state, the engine stream of one request (with its
metrics), SSE framing, and the checks of model name and length. Endpoint modules import this;
it imports none of them, so the server package reads top-down."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import Response

from kdaserve.client.request_client import EngineError, RequestClient
from kdaserve.multimodal import ImageInputs
from kdaserve.request import RequestOptions, RequestOutput, SamplingParams
from kdaserve.server.media import MediaLoader
from kdaserve.server.metrics import ServerMetrics
from kdaserve.server.protocol import error_body
from kdaserve.server.response_store import ResponseStore
from kdaserve.server.sampling import Sampling
from kdaserve.tokenizer import Tokenizer


@dataclass(frozen=True)
class Limits:
    """What one client may take (flags of `kdaserve serve`)."""

    max_body_bytes: int = 8 << 20  # a 128k-token prompt is ~0.5 MB of text
    body_read_timeout: float = 30.0  # seconds between body chunks
    max_queued_requests: int = 1024  # sequences in flight; more get 429 + Retry-After
    request_timeout: float | None = None  # seconds from arrival to the last token
    watchdog_timeout: float = 120.0  # no step this long with requests waiting: unhealthy


T = TypeVar("T")


class ChatEndpoint(Protocol):
    """What the state knows of the chat handler (chat.py, which imports this module; its
    users take it whole through `chat.chat_handler`)."""
    @property
    def sampling(self) -> Sampling: ...


class QueueFullError(Exception):
    """Too many requests in flight: HTTP 429 with Retry-After."""


@dataclass
class ServerState:
    client: RequestClient  # one engine process, or the data-parallel replicas
    tokenizer: Tokenizer | None  # None with --skip-tokenizer-init: token ids in and out
    model_name: str
    model_path: str
    max_request_tokens: int
    metrics: ServerMetrics
    chat: ChatEndpoint | None
    api_key: str | None = None
    server_args: dict[str, Any] = field(default_factory=dict)  # reported by /get_server_info
    responses: ResponseStore | None = None  # stored /v1/responses (previous_response_id, GET)
    limits: Limits = field(default_factory=Limits)
    media: MediaLoader | None = None  # loads requests' images (None: the model takes none)
    # other names requests may give the model besides model_name and model_path (the names
    # earlier versions served it under: `--model` as typed)
    model_aliases: tuple[str, ...] = ()
    in_flight: int = 0  # engine requests submitted and not yet finished
    # RL (server/rl.py): new requests wait at the gate while weights change
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    update_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    paused: bool = False
    weight_version: str = "default"
    # every endpoint's way to SamplingParams (server/sampling.py): the chat handler's, which
    # knows the chat format's default mode, when there is one
    sampling: Sampling = field(default_factory=Sampling)

    def __post_init__(self) -> None:
        self.gate.set()
        if self.chat is not None:
            self.sampling = self.chat.sampling

    def engine_restarted(self) -> None:
        """A restarted engine serves its start-up checkpoint, unpaused: say so."""
        self.weight_version, self.paused = "default", False

    def need_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(f"{what} needs a tokenizer, but the server runs with "
                             "--skip-tokenizer-init: send token ids (/generate input_ids)")
        return self.tokenizer


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def stream_error(e: Exception) -> str:
    """The last event of a stream that failed after it started (its HTTP status is already
    sent): an OpenAI-style error object, and no [DONE], so clients see it did not finish."""
    status = e.status if isinstance(e, EngineError) else 500
    return sse(error_body(str(e), status))


async def timed(state: ServerState, prompt_ids: list[int], params: SamplingParams,
                rid: str, options: RequestOptions | None = None,
                images: ImageInputs | None = None) -> AsyncIterator[RequestOutput]:
    """The engine stream of one request, recording TTFT / ITL / E2E and finish reasons."""
    limits = state.limits
    start = last_at = time.perf_counter()
    first = True
    timeout = limits.request_timeout
    await state.gate.wait()  # a weight update in progress
    gen = state.client.generate(prompt_ids, params, rid, options, images)
    state.in_flight += params.n
    try:
        while True:
            left = None if timeout is None else start + timeout - time.perf_counter()
            try:
                out = await asyncio.wait_for(gen.__anext__(), left)
            except StopAsyncIteration:
                return
            except TimeoutError:  # the engine request is aborted as the generator closes
                raise EngineError(f"request timed out after {timeout:g} s "
                                  "(--request-timeout)", 504) from None
            now = time.perf_counter()
            (state.metrics.ttft if first else state.metrics.itl).observe(now - last_at)
            first, last_at = False, now
            if out.finished:
                state.metrics.e2e.observe(now - start)
                for o in out.outputs:
                    state.metrics.requests.labels(o.finish_reason or "unknown").inc()
            yield out
    finally:
        state.in_flight -= params.n
        await gen.aclose()


async def off_loop(state: ServerState, images: bool, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on a worker thread, off the event loop: a request with images on the media
    loader's own threads (fetching and decoding them may be slow), any other on asyncio's."""
    if images and state.media is not None:
        return await asyncio.get_running_loop().run_in_executor(
            state.media.executor, functools.partial(fn, *args))
    return await asyncio.to_thread(fn, *args)


def admit(state: ServerState, sequences: int) -> None:
    """Room for a request's sequences (prompts x n) among those in flight, checked before it
    starts: 429 when the server is full now, 400 when it never could take this many."""
    limit = state.limits.max_queued_requests
    if sequences > limit:
        raise ValueError(f"{sequences} sequences in one request; the server takes at most "
                         f"{limit} at once (--max-queued-requests)")
    if state.in_flight + sequences > limit:
        raise QueueFullError(f"{state.in_flight} sequences in flight, the limit is {limit} "
                             "(--max-queued-requests); retry")


async def first_then_rest(gen: AsyncIterator[RequestOutput]) -> tuple[RequestOutput,
                                                                      AsyncIterator[RequestOutput]]:
    """Awaits the first update, so request errors surface as an HTTP status before streaming."""
    first = await gen.__anext__()

    async def chain() -> AsyncIterator[RequestOutput]:
        try:
            yield first
            async for item in gen:
                yield item
        finally:  # closing the chain closes the stream (and so aborts its request)
            await gen.aclose()  # type: ignore[attr-defined]

    return first, chain()


async def last(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = None
    async for out in gen:
        final = out
    assert final is not None
    return final


async def all_finals(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """The final output of every stream; if one fails, the others are cancelled (aborting
    their engine requests) before the error propagates: no orphans keep generating."""
    tasks = [asyncio.ensure_future(last(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def until_disconnect(request: Request, work: Any) -> Response:
    """Runs a handler; if the client goes away before a non-streaming answer is ready, cancels
    it, which aborts its engine requests and frees their blocks and slots. (A streaming
    response returns at once; its disconnects end the stream the same way.)"""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.2)
            if done:
                return task.result()
            if await request.is_disconnected():
                break
    except asyncio.CancelledError:  # we are cancelled (shutdown): so is the work, now
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, EngineError):
            await task
        raise
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, EngineError):
        await task
    return Response(status_code=499)  # nginx's "client closed request"


class ModelNotFoundError(Exception):
    """A request for a model this server does not serve: HTTP 404, as OpenAI answers."""


def check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name not in (state.model_name, state.model_path,
                                         *state.model_aliases):
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


def token_str(tok: Tokenizer | None, tid: int) -> str | None:
    return None if tok is None else tok.decode([tid], skip_special_tokens=False)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
