"""The engine loop shared by the in-process thread (`AsyncLLM`) and the engine process of the
server: commands in, step, outputs out (messages.py names both). Transport-agnostic: `recv`
and `send` are given. A call that waits on something outside the engine (a trainer's
rendezvous) returns a Future; its reply goes out when it completes, and the loop serves
meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
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
    Stop,
    Tick,
)
from kdaserve.engine.llm_engine import LLMEngine
from kdaserve.engine.rl import EngineAsleep
from kdaserve.request import RequestOutput

logger = logging.getLogger("kdaserve")

TICK_S = 1.0  # a Tick at most this often: the loop is alive and between steps
PD_WAIT_S = 0.01  # waiting on a disaggregation peer: commands are read this often

# read-only or maintenance calls a client may make by name (functions do not cross processes)
CALLS: dict[str, Callable[..., Any]] = {
    "get_metrics": lambda e: e.get_metrics(),
    "check_integrity": lambda e: e.check_integrity(),
    "flush_cache": lambda e: e.flush_cache(),
    "weight_version": lambda e: e.rl.weight_version,
    **{name: (lambda e, *args, name=name: getattr(e.rl, name)(*args)) for name in (
        "update_weights_from_disk", "update_weights_from_tensor", "init_weights_update_group",
        "update_weights_from_distributed", "destroy_weights_update_group",
        "release_memory_occupation", "resume_memory_occupation", "pause_generation",
        "continue_generation")},
    "model_info": lambda e: {"model_path": str(e.path), "vocab_size": e.model_config.vocab_size,
                             "max_request_tokens": e.scheduler.max_request_tokens()},
}


Send = Callable[[Message], None]


def run_engine_loop(engine: LLMEngine, recv: Callable[[bool], Command | None],
                    send: Send) -> None:
    """Runs until a Stop command. recv(block) waits briefly for a command when block."""
    idle_step = False
    last_tick = 0.0
    deferred: list[tuple[int, Future]] = []  # (token, the call's result to come)
    while True:
        now = time.monotonic()
        if now - last_tick >= TICK_S:  # the HTTP side's watchdog listens
            send(Tick())
            last_tick = now
        for token, future in [d for d in deferred if d[1].done()]:
            deferred.remove((token, future))
            err = future.exception()
            send(Reply(token, None if err else future.result(),
                       f"{type(err).__name__}: {err}" if err else None))
        # wait for commands when there is nothing to run, or when the last step could schedule
        # nothing (requests waiting for memory): never spin
        block = idle_step or not engine.has_unfinished() or engine.rl.paused
        lockstep = engine.ep.size > 1  # DP attention: every rank steps whenever any does
        if lockstep:
            block = engine.lockstep_idle and not engine.has_unfinished()
        if block and engine.pd is not None and engine.pd.busy() and not engine.rl.paused:
            engine.pd.wait(PD_WAIT_S)  # a transfer's next message, not the command poll
            block = False
        while (cmd := recv(block)) is not None:
            block = False
            if isinstance(cmd, Stop):
                return
            _handle(engine, cmd, send, deferred)
        if (not engine.has_unfinished() or engine.rl.paused) and not lockstep:
            # e.g. requests aborted by a pause: tell them; and disaggregation peers are
            # answered (pings, reservations) whether or not we step
            pending = engine.drain_outputs() + engine.service_disaggregation()
            # a peer's refusal or a failed transfer can end a request here, between steps
            pending = _report_failures(engine, pending, send)
            if pending:
                send(Outputs(pending))
            continue
        steps = engine.out.counters["num_steps"]
        try:
            outputs = engine.step()
            idle_step = engine.out.counters["num_steps"] == steps and not outputs
        except Exception as e:  # a failed step fails the requests in flight, loudly
            if engine.followers is not None or lockstep:  # a rank is gone: collectives broken
                # said in our words: the collective library's message depends on where the
                # peer was when it died (closed, reset, broken pipe, timeout)
                logger.error("a parallel rank is gone (%s: %s): the engine stops",
                             type(e).__name__, e)
                raise
            logger.exception("engine step failed")
            for rid in list(engine.out.groups):
                engine.abort(rid)
                send(RequestFailed(rid, f"engine step failed: {e}", 500))
            engine.step()  # drain the abort outputs of the failed requests
            continue
        outputs = _report_failures(engine, outputs, send)
        if outputs:
            send(Outputs(outputs))


def _report_failures(engine: LLMEngine, outputs: list[RequestOutput],
                     send: Send) -> list[RequestOutput]:
    """Sends an error for each request that failed on its own (not the batch); returns the
    outputs of the others."""
    failed = engine.take_failures()
    for rid, why in failed:
        send(RequestFailed(rid, why, 500))
    gone = {rid for rid, _ in failed}
    return [o for o in outputs if o.rid not in gone] if gone else outputs


def _handle(engine: LLMEngine, cmd: Command, send: Send,
            deferred: list[tuple[int, Future]]) -> None:
    match cmd:
        case AddRequest(rid, prompt, params, options, images):
            try:
                engine.add_request(prompt, params, rid, options, images)
            except EngineAsleep as e:
                send(RequestFailed(rid, str(e), 503))
            except ValueError as e:
                send(RequestFailed(rid, str(e), 400))
            except Exception as e:  # noqa: BLE001 - a bug, but this request's: the loop goes on
                logger.exception("request %s: add_request failed", rid)
                if rid in engine.out.groups:
                    engine.abort(rid)
                send(RequestFailed(rid, f"{type(e).__name__}: {e}", 500))
        case Abort(rid):
            engine.abort(rid)
        case Call(token, method, args):
            try:
                result = CALLS[method](engine, *args)
                if isinstance(result, Future):
                    deferred.append((token, result))
                else:
                    send(Reply(token, result))
            except Exception as e:  # noqa: BLE001 - reported to the caller
                send(Reply(token, None, f"{type(e).__name__}: {e}"))
        case _:
            logger.error("unknown engine command %r", cmd)
