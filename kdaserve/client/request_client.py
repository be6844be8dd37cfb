"""What a server asks of an engine (`RequestClient`), and `EngineClient`, the asyncio side of
one engine loop (per-request streams, calls by name).

EngineClient's subclasses provide the transport (`_send`) and feed every message from the loop
to `_on_message`; `AsyncLLM` runs the loop in a thread, `EngineProcess` in another process over
ZeroMQ. The data-parallel controller (`data_parallel.py`) is a RequestClient over several
engine processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any

from kdaserve.client.messages import (
    Abort,
    AddRequest,
    Call,
    Command,
    Message,
    Outputs,
    Reply,
    RequestFailed,
    Tick,
)
from kdaserve.multimodal import ImageInputs
from kdaserve.request import RequestOptions, RequestOutput, SamplingParams


class EngineError(Exception):
    """A request failed in the engine; `status` is the HTTP status it maps to."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class RequestClient(ABC):
    """Requests in with their outputs streamed, aborts, and calls by name: one engine loop's
    client, or the data-parallel replicas behind one controller."""

    @abstractmethod
    async def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                          rid: str | None = None, options: RequestOptions | None = None,
                          images: ImageInputs | None = None,
                          ) -> tuple[str, AsyncIterator[RequestOutput]]:
        """Submits a request now; returns its id and its output stream (see `generate`)."""

    @abstractmethod
    async def abort(self, rid: str) -> None: ...

    @abstractmethod
    async def call(self, method: str, *args: Any) -> Any: ...

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       rid: str | None = None, options: RequestOptions | None = None,
                       images: ImageInputs | None = None) -> AsyncIterator[RequestOutput]:
        """Yields cumulative outputs as tokens arrive; the last has finished=True. Raises
        EngineError (status 400 for a bad request). Leaving early aborts the request."""
        _, stream = await self.add_request(prompt, params, rid, options, images)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()  # type: ignore[attr-defined] - runs its abort-on-exit now

    async def get_metrics(self) -> dict[str, Any]:
        return await self.call("get_metrics")


class EngineClient(RequestClient):
    def __init__(self) -> None:
        self._streams: dict[str, asyncio.Queue] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._tokens = itertools.count()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.last_tick = time.monotonic()

    # ---- transport ----
    def _send(self, cmd: Command) -> None:
        raise NotImplementedError

    def _on_message(self, msg: Message) -> None:
        """Called on the event loop for each message from the engine loop."""
        match msg:
            case Tick():  # the engine loop is alive and not stuck in a step
                self.last_tick = time.monotonic()
            case Outputs(outputs):
                for out in outputs:
                    q = self._streams.get(out.rid)
                    if q is not None:
                        q.put_nowait(out)
                        if out.finished:
                            del self._streams[out.rid]
            case RequestFailed(rid, message, status):
                q = self._streams.pop(rid, None)
                if q is not None:
                    q.put_nowait(EngineError(message, status))
            case Reply(token, result, error):
                fut = self._calls.pop(token, None)
                if fut is not None and not fut.done():
                    if error is None:
                        fut.set_result(result)
                    else:
                        fut.set_exception(EngineError(error, 500))

    def fail_all(self, message: str, status: int = 503) -> None:
        """The engine is gone: every waiting stream and call gets an error, none hangs."""
        for q in self._streams.values():
            q.put_nowait(EngineError(message, status))
        self._streams.clear()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineError(message, status))
        self._calls.clear()

    # ---- API ----
    async def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                          rid: str | None = None, options: RequestOptions | None = None,
                          images: ImageInputs | None = None,
                          ) -> tuple[str, AsyncIterator[RequestOutput]]:
        self.loop = asyncio.get_running_loop()
        rid = rid or uuid.uuid4().hex
        if rid in self._streams:
            raise EngineError(f"request id {rid!r} is already in use", 400)
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = q
        try:
            self._send(AddRequest(rid, prompt, params or SamplingParams(),
                                  options or RequestOptions(), images))
        except BaseException:  # e.g. the engine is restarting: the id stays free
            self._streams.pop(rid, None)
            raise
        return rid, self._stream(rid, q)

    async def _stream(self, rid: str, q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._streams.pop(rid, None)
                with contextlib.suppress(EngineError):  # a dead engine has nothing to abort
                    self._send(Abort(rid))

    async def abort(self, rid: str) -> None:
        self._streams.pop(rid, None)
        self._send(Abort(rid))

    async def call(self, method: str, *args: Any) -> Any:
        self.loop = asyncio.get_running_loop()
        token = next(self._tokens)
        fut = self.loop.create_future()
        self._calls[token] = fut
        self._send(Call(token, method, args))
        return await fut
