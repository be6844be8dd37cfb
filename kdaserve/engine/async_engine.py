"""AsyncLLM: the streaming interface (add_request, abort, a per-request output stream).

The engine runs in its own thread so a slow consumer never stalls the batch; callers on an
asyncio loop submit commands through a queue and receive `RequestOutput` updates on a
per-request asyncio.Queue. Leaving a stream early (client gone) aborts its request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kdaserve.config import EngineConfig
from kdaserve.engine.llm_engine import LLMEngine
from kdaserve.request import RequestOutput, SamplingParams

logger = logging.getLogger("kdaserve")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncLLM:
    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(config or EngineConfig.from_kwargs(**kwargs))
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kdaserve-engine", daemon=True)
        self._thread.start()

    # ---- engine thread ----
    def _loop(self) -> None:
        while not self._stopped.is_set():
            block = not self.engine.has_unfinished()
            try:
                while True:
                    self._run_command(self._commands.get(block=block, timeout=0.05))
                    block = False
            except queue.Empty:
                pass
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a failed step fails every request in flight, loudly
                logger.exception("engine step failed")
                for rid, stream in list(self._streams.items()):
                    self.engine.abort(rid)
                    stream.put(e)
                self._streams.clear()
                continue
            for out in outputs:
                stream = self._streams.get(out.rid)
                if stream is not None:
                    stream.put(out)
                    if out.finished:
                        del self._streams[out.rid]

    def _run_command(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, prompt, params, rid, stream, fut = cmd
            try:
                rid = self.engine.add_request(prompt, params, rid)
            except Exception as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
                return
            self._streams[rid] = stream
            fut.set_result(rid)
        elif kind == "abort":
            _, rid, fut = cmd
            self._streams.pop(rid, None)
            fut.set_result(self.engine.abort(rid))
        elif kind == "call":
            _, fn, fut = cmd
            try:
                fut.set_result(fn(self.engine))
            except Exception as e:  # noqa: BLE001
                fut.set_exception(e)

    def _submit(self, *cmd: Any) -> concurrent.futures.Future:
        if self._stopped.is_set():
            raise RuntimeError("engine is shut down")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((*cmd, fut))
        return fut

    # ---- caller side (asyncio) ----
    async def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                          rid: str | None = None) -> tuple[str, asyncio.Queue]:
        stream = _Stream(asyncio.get_running_loop())
        rid = await asyncio.wrap_future(self._submit("add", prompt, params, rid, stream))
        return rid, stream.queue

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       rid: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yields cumulative outputs as tokens arrive; the last one has finished=True.
        Raises ValueError for a bad request (the engine stays healthy)."""
        rid, q = await self.add_request(prompt, params, rid)
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                await self.abort(rid)

    async def abort(self, rid: str) -> bool:
        return await asyncio.wrap_future(self._submit("abort", rid))

    async def call(self, fn: Any) -> Any:
        """Runs fn(engine) on the engine thread (metrics, integrity checks)."""
        return await asyncio.wrap_future(self._submit("call", fn))

    async def get_metrics(self) -> dict[str, int]:
        return await self.call(lambda e: e.get_metrics())

    def shutdown(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=10)
