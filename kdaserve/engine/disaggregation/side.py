"""What both sides of a disaggregated pair share: the transfer engine with the pools
registered, the layout, message checks, counters."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from kdaserve.cache.block_pool import BlockPool
from kdaserve.cache.radix_cache import RadixCache
from kdaserve.cache.state_pool import StatePool
from kdaserve.config import ModelConfig
from kdaserve.engine.disaggregation.layout import PoolLayout, model_fingerprint
from kdaserve.engine.disaggregation.mooncake import MooncakeTransfer
from kdaserve.engine.outputs import OutputProcessor
from kdaserve.engine.scheduler import Scheduler
from kdaserve.engine_config import EngineConfig
from kdaserve.models.kimi_linear import KimiLinearForCausalLM
from kdaserve.request import Request

logger = logging.getLogger("kdaserve")

PING_S = 1.0
MAX_MESSAGE_BYTES = 16 << 20  # a reservation of a 1M-token prompt is ~0.5 MB


def prompt_hash(ids: list[int]) -> str:
    return hashlib.sha256(torch.tensor(ids, dtype=torch.int64).numpy().tobytes()).hexdigest()


def decode(raw: bytes) -> dict[str, Any]:
    """A peer's JSON message: an object with a string "type" (ValueError otherwise)."""
    msg = json.loads(raw)
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise ValueError("not a message object")
    return msg


def integer(msg: dict[str, Any], key: str, default: int | None = None) -> int:
    """An integer field (bools, floats, inf and strings are refused)."""
    v = msg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{key} must be an integer")
    return v


def number(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ValueError("not a finite number")
    return float(v)


def encode(msg: dict[str, Any]) -> bytes:
    return json.dumps(msg).encode()


@dataclass(frozen=True)
class SideHost:
    """What a side uses of its engine: the pools it transfers (and the model they belong
    to), the scheduler its requests run in, and where their tokens and failures go."""
    config: EngineConfig
    model_config: ModelConfig
    model: KimiLinearForCausalLM
    blocks: BlockPool
    states: StatePool
    cache: RadixCache | None
    scheduler: Scheduler
    out: OutputProcessor


class Side:
    def __init__(self, host: SideHost) -> None:
        c = host.config
        self.host = host
        self.timeout_s, self.liveness_s = c.disaggregation_timeout_s, c.disaggregation_liveness_s
        self.transfer = MooncakeTransfer(c.disaggregation_host)
        fingerprint = model_fingerprint(dataclasses.asdict(host.model_config), host.model)
        self.layout = PoolLayout.of(fingerprint, host.blocks, host.states)
        for t in self.layout.tensors():
            self.transfer.register(t.address, t.nbytes)
        self.ctx = zmq.Context.instance()
        self.counters = {"pd_transfers": 0, "pd_failed": 0, "pd_writes": 0, "pd_kv_bytes": 0,
                         "pd_state_bytes": 0, "pd_transfer_ms": 0.0}

    def socket(self, kind: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        return sock

    def sockets(self) -> list[zmq.Socket]:
        raise NotImplementedError

    def wait(self, timeout_s: float) -> None:
        """Sleeps until a peer's message arrives or timeout_s passes (the engine loop, idle
        but for transfers, wakes for them at once instead of at its next command poll)."""
        poller = zmq.Poller()
        for sock in self.sockets():
            poller.register(sock, zmq.POLLIN)
        poller.poll(timeout_s * 1e3)

    def fail(self, req: Request, why: str) -> None:
        self.counters["pd_failed"] += 1
        logger.warning("request %s: %s", req.rid, why)
        self.host.out.fail(req.rid, why)

    def close(self) -> None:
        for sock in self.sockets():
            sock.close(linger=0)
        self.transfer.unregister_all()
