"""The prefill server's side: the bootstrap endpoint, pairing requests with reservations,
writing each request's caches into its reservation, "done" with the first token."""

from __future__ import annotations

import base64
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import zmq

from kdaserve.engine.disaggregation.layout import PoolLayout, spans
from kdaserve.engine.disaggregation.side import (
    Side,
    SideHost,
    decode,
    encode,
    integer,
    number,
    prompt_hash,
)
from kdaserve.request import Request
from kdaserve.scheduled_batch import ScheduledBatch

logger = logging.getLogger("kdaserve")

MAX_OFFERS = 4096  # reservations waiting for their request; the oldest are refused beyond
ENDED_MEMORY = 4096  # rooms that ended here, so a late reservation is refused at once


@dataclass(slots=True)
class Outgoing:
    """A request whose decode side has reserved memory."""

    req: Request
    peer: bytes  # the decode side's ZeroMQ identity
    tid: str  # the reservation's id, echoed in every reply
    session: str  # its Mooncake session
    layout: PoolLayout
    blocks: list[int]
    slot: int
    liveness_s: float  # the decode side gives up on us after this long unanswered
    sent: int = 0  # leading blocks already written


@dataclass(slots=True)
class Offer:
    peer: bytes
    msg: dict[str, Any]
    since: float = field(default_factory=time.monotonic)


class PrefillSide(Side):
    def __init__(self, host: SideHost) -> None:
        super().__init__(host)
        c = host.config
        self.sock = self.socket(zmq.ROUTER)
        bind = "*" if c.disaggregation_host in ("0.0.0.0", "") else c.disaggregation_host
        self.sock.bind(f"tcp://{bind}:{c.disaggregation_bootstrap_port}")
        self.waiting: dict[int, tuple[Request, float]] = {}  # room -> request, since
        self.offers: OrderedDict[int, Offer] = OrderedDict()  # reservations, no request yet
        self.active: dict[int, Outgoing] = {}
        self.by_req: dict[int, int] = {}  # id(request) -> room
        self.heard: dict[bytes, float] = {}  # decode peer -> when it last spoke
        self.ended: OrderedDict[int, None] = OrderedDict()

    def sockets(self) -> list[zmq.Socket]:
        return [self.sock]

    def busy(self) -> bool:
        return bool(self.waiting or self.offers)

    def held(self) -> tuple[list[int], list[int]]:
        return [], []  # nothing here is held outside the scheduler

    def add(self, req: Request) -> None:
        room = req.options.bootstrap.room  # type: ignore[union-attr] - checked by the engine
        if room in self.waiting or room in self.active:
            raise ValueError(f"bootstrap_room {room} is already in use")
        self.ended.pop(room, None)  # a room may be used again once its last use ended
        self.waiting[room] = (req, time.monotonic())
        if room in self.offers:
            offer = self.offers.pop(room)
            self._start(room, offer.peer, offer.msg)

    def abort(self, req: Request) -> None:
        room = self.by_req.pop(id(req), None)
        if room is not None:
            out = self.active.pop(room)
            self._reply(out.peer, "failed", room, out.tid,
                        error="the request was aborted on the prefill server")
            self._ended(room)
        for room, (r, _) in list(self.waiting.items()):
            if r is req:
                del self.waiting[room]
                self._ended(room)

    def _ended(self, room: int) -> None:
        self.ended[room] = None
        while len(self.ended) > ENDED_MEMORY:
            self.ended.popitem(last=False)

    def _reply(self, peer: bytes, kind: str, room: int, tid: Any, **fields: Any) -> None:
        try:
            self.sock.send_multipart([peer, encode({"type": kind, "room": room, "tid": tid,
                                                    **fields})], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the peer is gone: its side times out
            logger.warning("bootstrap: could not reply to a decode server: %s", e)

    def poll(self) -> None:
        """Messages from decode servers (reservations, pings, cancels), then timeouts."""
        while self.sock.poll(0):
            frames = self.sock.recv_multipart()
            if len(frames) != 2:
                logger.warning("bootstrap: a message of %d frames dropped", len(frames))
                continue
            peer, raw = frames
            self.heard[peer] = time.monotonic()
            try:
                self._handle(peer, decode(raw))
            except (ValueError, KeyError, TypeError, OverflowError) as e:
                logger.warning("bootstrap: malformed message dropped: %s", e)
        now = time.monotonic()
        for room, (req, since) in list(self.waiting.items()):
            if now - since > self.timeout_s:
                del self.waiting[room]
                self._ended(room)
                self.fail(req, f"no decode server reserved memory for bootstrap_room {room} "
                               f"within {self.timeout_s:g} s")
        for room, offer in list(self.offers.items()):
            if now - offer.since > self.timeout_s:
                del self.offers[room]
                self._reply(offer.peer, "failed", room, offer.msg.get("tid"), error=(
                    f"no request with bootstrap_room {room} reached the prefill server "
                    f"within {self.timeout_s:g} s"))

    def _handle(self, peer: bytes, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == "ping":
            self._reply(peer, "pong", 0, None)
            return
        room, tid = integer(msg, "room"), str(msg.get("tid"))
        if kind == "reserve":
            if room in self.offers or room in self.active or room in self.ended:
                self._reply(peer, "failed", room, tid, error=f"bootstrap_room {room} is in use "
                            "or already ended on the prefill server")
            elif room in self.waiting:
                self._start(room, peer, msg)
            else:
                self.offers[room] = Offer(peer, msg)
                if len(self.offers) > MAX_OFFERS:
                    old, offer = self.offers.popitem(last=False)
                    self._reply(offer.peer, "failed", old, offer.msg.get("tid"),
                                error="too many reservations waiting on the prefill server")
        elif kind == "cancel":  # honoured from the reservation's own peer only
            offer = self.offers.get(room)
            if offer is not None and offer.peer == peer and offer.msg.get("tid") == tid:
                del self.offers[room]
            out = self.active.get(room)
            if out is not None and out.peer == peer and out.tid == tid:
                # no write happens after this: writes run inside steps, not between them
                del self.active[room]
                self.by_req.pop(id(out.req), None)
                self._ended(room)
                self.fail(out.req, "the decode server cancelled the transfer")
            self._reply(peer, "cancelled", room, tid)

    def _start(self, room: int, peer: bytes, msg: dict[str, Any]) -> None:
        req, _ = self.waiting.pop(room)
        tid = str(msg.get("tid"))
        try:
            layout = PoolLayout.from_dict(msg["layout"])
            blocks = msg["blocks"]
            if not isinstance(blocks, list) or not all(
                    isinstance(b, int) and not isinstance(b, bool) for b in blocks):
                raise ValueError("blocks must be a list of integers")
            slot, prompt_len = integer(msg, "slot"), integer(msg, "prompt_len")
            session, liveness = str(msg["session"]), number(msg["liveness_s"])
            why = self.layout.mismatch(layout)
            if why is None and (prompt_len != len(req.prompt_ids)
                                or msg.get("prompt_hash") != prompt_hash(req.prompt_key)):
                why = (f"prompt mismatch: the decode server tokenized {prompt_len} tokens, "
                       f"this server {len(req.prompt_ids)} (another tokenizer or template?)")
            need = self.host.blocks.blocks_needed(len(req.prompt_ids))
            if why is None and len(blocks) < need:
                why = f"the decode server reserved {len(blocks)} blocks, the prompt needs {need}"
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            why = f"malformed reservation: {e}"
        if why is not None:
            self._reply(peer, "failed", room, tid, error=why)
            self._ended(room)
            self.fail(req, f"transfer refused: {why}")
            return
        self.active[room] = Outgoing(req, peer, tid, session, layout, blocks, slot, liveness)
        self.by_req[id(req)] = room
        self.host.scheduler.add(req)

    def after_forward(self, batch: ScheduledBatch) -> None:
        """Writes each request's newly complete blocks; after its last prompt chunk the rest
        and its state (final only now). A decode peer silent for half its liveness window may
        have given the memory up: then nothing is written and the request fails."""
        bs = self.host.blocks.block_size
        for req in batch.reqs:
            room = self.by_req.get(id(req))
            if room is None:
                continue
            out = self.active[room]
            prompt = len(req.prompt_ids)
            final = req.num_computed_tokens >= prompt
            done = self.host.blocks.blocks_needed(prompt) if final \
                else req.num_computed_tokens // bs
            if done <= out.sent and not final:
                continue
            start = time.perf_counter()
            try:
                silent = time.monotonic() - self.heard.get(out.peer, 0.0)
                if silent > out.liveness_s / 2:
                    raise ConnectionError(f"the decode server has been silent for {silent:.0f} s")
                todo = spans(self.layout, out.layout, req.block_ids[out.sent:done],
                             out.blocks[out.sent:done], req.state_slot if final else None,
                             out.slot if final else None)
                self.transfer.write(out.session, todo)
            except (ConnectionError, ValueError) as e:
                del self.active[room]
                self.by_req.pop(id(req), None)
                self._ended(room)
                self._reply(out.peer, "failed", room, out.tid, error=str(e))
                self.fail(req, f"transfer to the decode server failed: {e}")
                continue
            self.counters["pd_transfer_ms"] += (time.perf_counter() - start) * 1e3
            self.counters["pd_writes"] += 1
            state_bytes = self.layout.recurrent.item_bytes * self.layout.recurrent.shape[0] \
                + self.layout.conv.item_bytes * self.layout.conv.shape[0] if final else 0
            self.counters["pd_state_bytes"] += state_bytes
            self.counters["pd_kv_bytes"] += sum(n for _, _, n in todo) - state_bytes
            out.sent = done

    def after_sample(self, batch: ScheduledBatch) -> None:
        """Sends "done" with the first token of each request whose prompt is complete; the
        prefill server's part of the request ends there."""
        for req in batch.reqs:
            room = self.by_req.get(id(req))
            if room is None or not req.output_ids:
                continue
            out = self.active.pop(room)
            del self.by_req[id(req)]
            self._ended(room)
            top = req.logprobs[-1] if req.params.logprobs is not None and req.logprobs else None
            gen = req.generator
            self._reply(out.peer, "done", room, out.tid, token=req.output_ids[0],
                        logprob=req.cumulative_logprob if top is not None else None,
                        top=[[t, lp] for t, lp in top.items()] if top is not None else None,
                        generator=base64.b64encode(gen.get_state().numpy().tobytes()).decode()
                        if gen is not None else None,
                        cached=req.num_cached_prompt, prompt_hash=prompt_hash(req.prompt_key))
            self.counters["pd_transfers"] += 1
            if not req.is_finished:
                self.host.scheduler.finish(req, "length")
