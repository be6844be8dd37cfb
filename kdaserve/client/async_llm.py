"""AsyncLLM: the streaming interface in-process — the engine loop in a thread, per-request
asyncio streams (add_request via `generate`, `abort`, metrics). A slow consumer never stalls the
batch; leaving a stream early aborts its request."""

from __future__ import annotations

import queue
import threading
from typing import Any

from kdaserve.client.engine_loop import run_engine_loop
from kdaserve.client.messages import Command, Message, Stop
from kdaserve.client.request_client import EngineClient
from kdaserve.engine.llm_engine import LLMEngine
from kdaserve.engine_config import EngineConfig

POLL_S = 0.05


class AsyncLLM(EngineClient):
    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.engine = LLMEngine(config or EngineConfig.from_kwargs(**kwargs))
        self._commands: queue.Queue[Command] = queue.Queue()
        self._thread = threading.Thread(target=run_engine_loop, name="kdaserve-engine",
                                        args=(self.engine, self._recv, self._deliver),
                                        daemon=True)
        self._thread.start()

    def _recv(self, block: bool) -> Command | None:
        try:
            return self._commands.get(block=block, timeout=POLL_S if block else None)
        except queue.Empty:
            return None

    def _deliver(self, msg: Message) -> None:  # engine thread -> event loop
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._on_message, msg)

    def _send(self, cmd: Command) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("engine is shut down")
        self._commands.put(cmd)

    def shutdown(self) -> None:
        self._commands.put(Stop())
        self._thread.join(timeout=10)
