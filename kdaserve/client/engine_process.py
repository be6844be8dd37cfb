"""The engine in its own process, connected to the HTTP process by ZeroMQ.

HTTP stays responsive while the model computes (like SGLang's tokenizer manager <-> scheduler):
the HTTP process PUSHes commands, the engine process PUSHes outputs back; both sides exchange
pickled message dataclasses (messages.py). A watchdog turns an engine crash into 503s, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from kdaserve.client.messages import (
    Command,
    Message,
    Outputs,
    Ready,
    RequestFailed,
    StartFailed,
    Stop,
)
from kdaserve.client.output_delta import DeltaDecoder, DeltaEncoder
from kdaserve.client.request_client import EngineClient, EngineError
from kdaserve.engine.lifecycle import run_with_parent
from kdaserve.engine_config import EngineConfig

logger = logging.getLogger("kdaserve")

POLL_MS = 50
IPC_PREFIX = "kdaserve-"


def ipc_dir() -> str:
    """A private folder (0700) for one server's IPC sockets, named after the server's pid.

    Its server removes it on every exit it lives through. A server killed with SIGKILL cannot,
    and its engine cannot either (SIGKILLed with it: lifecycle.exit_with_parent), so the next
    server started on this machine sweeps such folders first. They hold only socket files: no
    data, no memory. The engine creates nothing else that outlives it (multiprocessing's
    resource tracker, which outlives both, unlinks what was registered with it), except a
    native kernel build cut short: its compiler finishes, and the unrenamed `tmp*.so` stays
    in the kernel cache folder (kernels/native/build.py)."""
    sweep_ipc_dirs(Path(tempfile.gettempdir()))
    return tempfile.mkdtemp(prefix=f"{IPC_PREFIX}{os.getpid()}-")


def sweep_ipc_dirs(tmp: Path) -> list[Path]:
    """Removes the IPC folders of dead servers (ours, named `kdaserve-PID-*`, whose PID is gone
    and whose socket nobody listens on: a pid alone could be another PID namespace's)."""
    removed = []
    for d in tmp.glob(f"{IPC_PREFIX}*-*"):
        pid = d.name.removeprefix(IPC_PREFIX).split("-")[0]
        try:
            owned = d.is_dir() and not d.is_symlink() and d.stat().st_uid == os.getuid()
        except OSError:
            continue
        if owned and pid.isdigit() and not _alive(int(pid)) and not _listening(d / "out"):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            return False
        except OSError:  # unsure: keep it
            return True
    return True


def _engine_main(config: EngineConfig, cmd_addr: str, out_addr: str, parent: int) -> None:
    """The engine process, run by lifecycle.run_with_parent: it ends with the HTTP process
    (`parent`), however that one ends (the IPC folder left then: see ipc_dir)."""
    logging.basicConfig(level=logging.INFO, format="[kdaserve engine] %(message)s")
    # Ctrl-C and a group-wide SIGTERM (systemd, `kill -- -PGID`) reach us too; the HTTP
    # process decides when we stop, after draining
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from kdaserve.client.engine_loop import run_engine_loop
    from kdaserve.engine.llm_engine import LLMEngine

    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.connect(out_addr)
    cmds = ctx.socket(zmq.PULL)
    cmds.bind(cmd_addr)
    try:
        engine = LLMEngine(config)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which exits
        out.send_pyobj(StartFailed(f"{type(e).__name__}: {e}"))
        raise
    out.send_pyobj(Ready({"model_path": str(engine.path), "summary": engine.summary(),
                          "max_request_tokens": engine.scheduler.max_request_tokens(),
                          **engine.images.info}))

    def recv(block: bool) -> Command | None:
        if cmds.poll(POLL_MS if block else 0):
            return cmds.recv_pyobj()
        if os.getppid() != parent:  # the HTTP process is gone (seen here first without
            return Stop()  # PDEATHSIG; a subreaper, not pid 1, may have adopted us)
        return None

    encoder = DeltaEncoder()

    def send(msg: Message) -> None:
        if isinstance(msg, Outputs):  # each update as what changed since the last one sent
            msg = Outputs([encoder.encode(o) for o in msg.outputs])
        elif isinstance(msg, RequestFailed):
            encoder.forget(msg.rid)
        out.send_pyobj(msg)

    run_engine_loop(engine, recv, send)
    engine.close()
    out.close(linger=0)
    cmds.close(linger=0)
    ctx.term()


class EngineProcess(EngineClient):
    """Starts the engine process and is the HTTP process's client of it. If the engine dies,
    every request in flight gets a 503 and a fresh engine is started, up to `max_restarts`
    times; then `on_fatal` is called (the server exits non-zero, for a supervisor to act).

    Each engine gets its own command socket (a new IPC path per generation): commands queued
    for a dead engine are dropped with its socket, never delivered to its successor as
    requests nobody waits for."""

    def __init__(self, config: EngineConfig, max_restarts: int = 3,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self.config, self.max_restarts, self.on_fatal = config, max_restarts, on_fatal
        self._dir = ipc_dir()
        self.out_addr = f"ipc://{self._dir}/out"
        self.ctx = zmq.asyncio.Context()
        self._out = self.ctx.socket(zmq.PULL)
        self._out.bind(self.out_addr)
        # commands go out on a plain socket: a PUSH send never waits while the peer is up, and
        # a synchronous send needs no awaiting from the endpoints
        self._cmd_ctx = zmq.Context()
        self._cmd: Any = None
        self.generation = 0
        self.proc = self._new_process()
        self.info: dict[str, Any] = {}
        self.dead: str | None = None
        self.stopping = False  # shutting down: a dying engine is not restarted
        self.restarts = 0
        self._ready: asyncio.Queue[Ready] = asyncio.Queue()  # of a restarted engine
        # called after a restart: the new engine serves the checkpoint it was started on,
        # unpaused, whatever its predecessor had been sent
        self.on_restart: list[Callable[[], None]] = []
        self._tasks: list[asyncio.Task] = []
        self.last_tick = time.monotonic()
        self.deltas = DeltaDecoder()  # the engine process sends outputs as deltas

    def _new_process(self) -> BaseProcess:
        if self._cmd is not None:
            self._cmd.close(linger=0)  # what the old engine never read goes with it
        self.generation += 1
        cmd_addr = f"ipc://{self._dir}/cmd-{self.generation}"
        self._cmd = self._cmd_ctx.socket(zmq.PUSH)
        self._cmd.connect(cmd_addr)
        # PDEATHSIG fires when the forking *thread* ends: every engine is created and started
        # on the event loop's thread, the main one (asyncio.run), which ends with the process
        on_main = self._on_main = threading.current_thread() is threading.main_thread()
        # with tensor parallelism the engine starts the other ranks itself, which a daemonic
        # process may not (it stops with the server, and exits if orphaned, either way)
        return mp.get_context("spawn").Process(
            target=run_with_parent,
            args=(os.getpid(), on_main, f"{__name__}:_engine_main", self.config, cmd_addr,
                  self.out_addr, os.getpid()),
            daemon=self.config.tp_size == 1, name="kdaserve-engine")

    def _start_process(self) -> None:
        # the engine relies on PDEATHSIG only if the thread that forks it lives as long as we do
        assert not self._on_main or threading.current_thread() is threading.main_thread(), \
            "an engine created on the main thread must be started there"
        self.proc.start()
        logger.info("start-up engine: process %d started (generation %d)", self.proc.pid,
                    self.generation)

    async def start(self, timeout: float = 600.0) -> None:
        self.loop = asyncio.get_running_loop()
        self._start_process()
        msg = await asyncio.wait_for(self._wait_ready(), timeout)
        if isinstance(msg, StartFailed):
            raise RuntimeError(f"engine failed to start: {msg.message}")
        self.info = msg.info
        self.last_tick = time.monotonic()
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch())]

    async def _wait_ready(self) -> Ready | StartFailed:
        while True:
            if await self._out.poll(200):
                msg = await self._out.recv_pyobj()
                if isinstance(msg, Ready | StartFailed):
                    return msg
                continue  # late messages of a dead engine
            if not self.proc.is_alive():
                return StartFailed(f"engine process exited with code {self.proc.exitcode}")

    async def _receive(self) -> None:
        while True:
            msg = await self._out.recv_pyobj()
            if isinstance(msg, Ready):  # a restarted engine, awaited by _watch
                self.deltas.reset()  # (what the dead engine's last messages left)
                self._ready.put_nowait(msg)
                continue
            if isinstance(msg, Outputs):
                msg = Outputs([self.deltas.decode(d) for d in msg.outputs])
            elif isinstance(msg, RequestFailed):
                self.deltas.forget(msg.rid)
            self._on_message(msg)

    async def _watch(self) -> None:
        try:
            await self._keep_alive()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. a process that cannot start: give up
            logger.exception("engine watchdog failed")
            self.dead = f"engine watchdog failed: {e}"
            self.fail_all(self.dead, 503)
            self._fatal(self.dead)

    async def _keep_alive(self) -> None:
        while True:
            while self.proc.is_alive():
                await asyncio.sleep(0.2)
            self.dead = f"engine process died (exit code {self.proc.exitcode})"
            logger.error("%s; failing all requests with 503", self.dead)
            self.fail_all(self.dead, 503)
            if self.stopping:
                return
            if self.restarts >= self.max_restarts:
                self._fatal(f"{self.dead}; {self.restarts} restarts used up")
                return
            self.restarts += 1
            logger.error("restarting the engine (%d of at most %d)", self.restarts,
                         self.max_restarts)
            self.dead = f"engine restarting after a crash ({self.restarts}/{self.max_restarts})"
            while not self._ready.empty():  # the Ready of an engine that died since
                self._ready.get_nowait()
            self.proc = self._new_process()
            self._start_process()
            ready: Ready | None = None
            while ready is None and self.proc.is_alive():
                with contextlib.suppress(TimeoutError):
                    ready = await asyncio.wait_for(self._ready.get(), 0.5)
            if ready is None:
                continue  # died while starting: counted, tried again
            self.info, self.dead, self.last_tick = ready.info, None, time.monotonic()
            for fn in self.on_restart:
                fn()
            logger.error("engine restarted")

    def fail_all(self, message: str, status: int = 503) -> None:
        self.deltas.reset()  # the engine's deltas end with it (a restarted one starts over)
        super().fail_all(message, status)

    def problem(self, stuck_after: float) -> str | None:
        """Why the engine cannot serve now, or None: dead, restarting, or alive but stuck (no
        step finished for `stuck_after` seconds while requests wait)."""
        if self.dead:
            return self.dead
        quiet = time.monotonic() - self.last_tick
        if self._streams and quiet > stuck_after:
            return f"engine stuck: no progress for {quiet:.0f} s with requests in flight"
        return None

    def _fatal(self, why: str) -> None:
        logger.error("giving up: %s", why)
        if self.on_fatal is not None:
            self.on_fatal(why)

    def _send(self, cmd: Command) -> None:
        if self.dead:
            raise EngineError(self.dead, 503)
        self._cmd.send_pyobj(cmd)

    async def shutdown(self) -> None:
        self.stopping = True
        for t in self._tasks:
            t.cancel()
        self.fail_all("the server is shutting down", 503)
        if self.proc.is_alive() and not self.dead and self.info:
            self._cmd.send_pyobj(Stop())
            await asyncio.to_thread(self.proc.join, 10)
        if self.proc.is_alive():  # still starting, or stuck: it ignores SIGTERM and SIGINT
            self.proc.kill()
            await asyncio.to_thread(self.proc.join, 5)
        self._out.close(linger=0)
        self._cmd.close(linger=0)
        self.ctx.term()
        self._cmd_ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)  # the IPC sockets' folder
