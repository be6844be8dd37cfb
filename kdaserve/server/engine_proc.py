"""The engine in its own process, connected to the HTTP process by ZeroMQ.

HTTP stays responsive while the model computes (like SGLang's tokenizer manager <-> scheduler):
the HTTP process PUSHes commands, the engine process PUSHes outputs back; both sides exchange
pickled tuples (see engine_loop). A watchdog turns an engine crash into 503s, never a hang.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import signal
import tempfile
from typing import Any

import zmq
import zmq.asyncio

from kdaserve.config import EngineConfig
from kdaserve.engine.client import EngineClient

logger = logging.getLogger("kdaserve")

POLL_MS = 50


def _engine_main(config: EngineConfig, cmd_addr: str, out_addr: str) -> None:
    """Entry point of the engine process."""
    logging.basicConfig(level=logging.INFO, format="[kdaserve engine] %(message)s")
    # Ctrl-C reaches the whole process group; the HTTP process decides when we stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from kdaserve.engine.engine_loop import run_engine_loop
    from kdaserve.engine.llm_engine import LLMEngine

    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.connect(out_addr)
    cmds = ctx.socket(zmq.PULL)
    cmds.bind(cmd_addr)
    try:
        engine = LLMEngine(config)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which exits
        out.send_pyobj(("failed", f"{type(e).__name__}: {e}"))
        raise
    out.send_pyobj(("ready", {"model_path": str(engine.path), "summary": engine.summary(),
                              "max_request_tokens": engine.scheduler.max_request_tokens()}))

    def recv(block: bool) -> tuple[Any, ...] | None:
        if cmds.poll(POLL_MS if block else 0):
            return cmds.recv_pyobj()
        if os.getppid() == 1:  # the HTTP process died without stopping us: no orphans
            return ("stop",)
        return None

    run_engine_loop(engine, recv, out.send_pyobj)
    out.close(linger=0)
    cmds.close(linger=0)
    ctx.term()


class EngineProcess(EngineClient):
    """Starts the engine process and is the HTTP process's client of it."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self._dir = tempfile.mkdtemp(prefix="kdaserve-")
        self.cmd_addr = f"ipc://{self._dir}/cmd"
        self.out_addr = f"ipc://{self._dir}/out"
        self.ctx = zmq.asyncio.Context()
        self._out = self.ctx.socket(zmq.PULL)
        self._out.bind(self.out_addr)
        # commands go out on a plain socket: a PUSH send never waits while the peer is up, and
        # a synchronous send needs no awaiting from the endpoints
        self._cmd_ctx = zmq.Context()
        self._cmd = self._cmd_ctx.socket(zmq.PUSH)
        self.proc = mp.get_context("spawn").Process(
            target=_engine_main, args=(config, self.cmd_addr, self.out_addr), daemon=True,
            name="kdaserve-engine")
        self.info: dict[str, Any] = {}
        self.dead: str | None = None
        self._tasks: list[asyncio.Task] = []

    async def start(self, timeout: float = 600.0) -> None:
        self.loop = asyncio.get_running_loop()
        self.proc.start()
        self._cmd.connect(self.cmd_addr)
        msg = await asyncio.wait_for(self._wait_ready(), timeout)
        if msg[0] == "failed":
            raise RuntimeError(f"engine failed to start: {msg[1]}")
        self.info = msg[1]
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch())]

    async def _wait_ready(self) -> tuple[Any, ...]:
        while True:
            if await self._out.poll(200):
                return await self._out.recv_pyobj()
            if not self.proc.is_alive():
                return ("failed", f"engine process exited with code {self.proc.exitcode}")

    async def _receive(self) -> None:
        while True:
            msg = await self._out.recv_pyobj()
            self._on_message(msg)

    async def _watch(self) -> None:
        while self.proc.is_alive():
            await asyncio.sleep(0.2)
        self.dead = f"engine process died (exit code {self.proc.exitcode})"
        logger.error("%s; failing all requests with 503", self.dead)
        self.fail_all(self.dead, 503)

    def _send(self, cmd: tuple[Any, ...]) -> None:
        from kdaserve.engine.client import EngineError

        if self.dead:
            raise EngineError(self.dead, 503)
        self._cmd.send_pyobj(cmd)

    async def shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self.proc.is_alive() and not self.dead:
            self._cmd.send_pyobj(("stop",))
            await asyncio.to_thread(self.proc.join, 10)
        if self.proc.is_alive():
            self.proc.terminate()
            await asyncio.to_thread(self.proc.join, 5)
        self._out.close(linger=0)
        self._cmd.close(linger=0)
        self.ctx.term()
        self._cmd_ctx.term()
