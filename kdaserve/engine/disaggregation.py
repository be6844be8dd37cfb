"""Prefill/decode disaggregation in the engine: SGLang's PD protocol for a KDA hybrid.

The PD router sends each request to a prefill and a decode server with the same
`bootstrap_room`. The decode side reserves the request's blocks and a state slot first and
sends the reservation (its Mooncake session, pool layout, block ids, slot) to the prefill
server's bootstrap endpoint (a ZeroMQ ROUTER); only then is the prompt scheduled on the
prefill side, so destination memory exists before any compute is spent. After every forward
the prefill side writes the request's newly complete blocks straight from its pool into the
decode side's reserved blocks (Mooncake, no staging copy); after the last chunk it writes the
tail block and every KDA layer's recurrent and conv state, then sends the first sampled token
("done"). The decode side then runs the request as a decode, with no forward over the prompt.

Failures free everything on both sides: a failed write (decode gone) fails the prefill
request; a decode side that hears nothing from its prefill peer for `liveness_s` (pings
unanswered) or waits past `timeout_s` fails its request and frees the reservation. A
reservation stays held until the prefill side confirms a cancel (or is dead), so a late write
never lands in memory already given to another request. Messages are JSON (never pickles
from the network).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import zmq

from kdaserve.disaggregation.layout import PoolLayout, model_fingerprint, spans
from kdaserve.disaggregation.mooncake import MooncakeTransfer
from kdaserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from kdaserve.engine.llm_engine import LLMEngine
    from kdaserve.engine.scheduler import ScheduledBatch

logger = logging.getLogger("kdaserve")

PING_S = 1.0


def prompt_hash(ids: list[int]) -> str:
    return hashlib.sha256(torch.tensor(ids, dtype=torch.int64).numpy().tobytes()).hexdigest()


class _Side:
    """What both sides share: the transfer engine with the pools registered, the layout,
    transfer counters."""

    def __init__(self, engine: LLMEngine) -> None:
        c = engine.config
        self.engine = engine
        self.timeout_s, self.liveness_s = c.disaggregation_timeout_s, c.disaggregation_liveness_s
        self.transfer = MooncakeTransfer(c.disaggregation_host)
        fingerprint = model_fingerprint(dataclasses.asdict(engine.model_config), engine.model)
        self.layout = PoolLayout.of(fingerprint, engine.blocks, engine.states)
        for t in self.layout.tensors():
            self.transfer.register(t.address, t.nbytes)
        self.ctx = zmq.Context.instance()
        self.counters = {"pd_transfers": 0, "pd_failed": 0, "pd_writes": 0, "pd_kv_bytes": 0,
                         "pd_state_bytes": 0, "pd_transfer_ms": 0.0}

    def sockets(self) -> list[zmq.Socket]:
        raise NotImplementedError

    def wait(self, timeout_s: float) -> None:
        """Sleeps until a peer's message arrives or timeout_s passes (the engine loop, idle
        but for transfers, wakes for them at once instead of at its next command poll)."""
        poller = zmq.Poller()
        for sock in self.sockets():
            poller.register(sock, zmq.POLLIN)
        poller.poll(timeout_s * 1e3)

    def _fail(self, req: Request, why: str) -> None:
        self.counters["pd_failed"] += 1
        logger.warning("request %s: %s", req.rid, why)
        self.engine.failures.append((req.rid, why))


@dataclass(slots=True)
class _Outgoing:
    """Prefill side: a request whose decode side has reserved memory."""

    req: Request
    peer: bytes  # the decode side's ZeroMQ identity
    session: str  # its Mooncake session
    layout: PoolLayout
    blocks: list[int]
    slot: int
    sent: int = 0  # leading blocks already written


class PrefillSide(_Side):
    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(engine)
        c = engine.config
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        host = "*" if c.disaggregation_host in ("0.0.0.0", "") else c.disaggregation_host
        self.sock.bind(f"tcp://{host}:{c.disaggregation_bootstrap_port}")
        self.waiting: dict[int, tuple[Request, float]] = {}  # room -> request, since
        self.offers: dict[int, tuple[bytes, dict[str, Any], float]] = {}  # room -> reservation
        self.active: dict[int, _Outgoing] = {}
        self.by_req: dict[int, int] = {}  # id(request) -> room

    def add(self, req: Request) -> None:
        room = req.params.bootstrap.room  # type: ignore[union-attr] - checked by the engine
        if room in self.waiting or room in self.active:
            raise ValueError(f"bootstrap_room {room} is already in use")
        self.waiting[room] = (req, time.monotonic())
        if room in self.offers:
            self._start(room, *self.offers.pop(room)[:2])

    def busy(self) -> bool:
        return bool(self.waiting or self.offers)

    def sockets(self) -> list[zmq.Socket]:
        return [self.sock]

    def abort(self, req: Request) -> None:
        room = self.by_req.pop(id(req), None)
        if room is not None:
            out = self.active.pop(room)
            self._send(out.peer, {"type": "failed", "room": room,
                                  "error": "the request was aborted on the prefill server"})
        for room, (r, _) in list(self.waiting.items()):
            if r is req:
                del self.waiting[room]

    def _send(self, peer: bytes, msg: dict[str, Any]) -> None:
        try:
            self.sock.send_multipart([peer, zmq.utils.jsonapi.dumps(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the peer is gone: its side times out
            logger.warning("bootstrap: could not reply to a decode server: %s", e)

    def poll(self) -> None:
        while self.sock.poll(0):
            peer, raw = self.sock.recv_multipart()
            try:
                msg = zmq.utils.jsonapi.loads(raw)
                kind, room = msg["type"], int(msg.get("room", 0))
            except (ValueError, KeyError, TypeError):
                logger.warning("bootstrap: malformed message dropped")
                continue
            if kind == "ping":
                self._send(peer, {"type": "pong"})
            elif kind == "reserve":
                if room in self.offers or room in self.active:
                    self._send(peer, {"type": "failed", "room": room,
                                      "error": f"bootstrap_room {room} is already in use"})
                elif room in self.waiting:
                    self._start(room, peer, msg)
                else:
                    self.offers[room] = (peer, msg, time.monotonic())
            elif kind == "cancel":
                self._cancel(room)
                self._send(peer, {"type": "cancelled", "room": room})
        now = time.monotonic()
        for room, (req, since) in list(self.waiting.items()):
            if now - since > self.timeout_s:
                del self.waiting[room]
                self._fail(req, f"no decode server reserved memory for bootstrap_room {room} "
                                f"within {self.timeout_s:g} s")
        for room, (peer, _, since) in list(self.offers.items()):
            if now - since > self.timeout_s:
                del self.offers[room]
                self._send(peer, {"type": "failed", "room": room, "error":
                                  f"no request with bootstrap_room {room} reached the prefill "
                                  f"server within {self.timeout_s:g} s"})

    def _cancel(self, room: int) -> None:
        self.offers.pop(room, None)
        out = self.active.pop(room, None)
        if out is not None:  # no write happens after this: writes run inside steps only
            self.by_req.pop(id(out.req), None)
            self._fail(out.req, "the decode server cancelled the transfer")

    def _start(self, room: int, peer: bytes, msg: dict[str, Any]) -> None:
        req, _ = self.waiting.pop(room)
        try:
            layout = PoolLayout.from_dict(msg["layout"])
            blocks, slot = [int(b) for b in msg["blocks"]], int(msg["slot"])
            session = str(msg["session"])
            why = self.layout.mismatch(layout)
            if why is None and (int(msg["prompt_len"]) != len(req.prompt_ids)
                                or msg["prompt_hash"] != prompt_hash(req.prompt_ids)):
                why = (f"prompt mismatch: the decode server tokenized {msg['prompt_len']} "
                       f"tokens, this server {len(req.prompt_ids)} (another tokenizer or "
                       "chat template?)")
            need = self.engine.blocks.blocks_needed(len(req.prompt_ids))
            if why is None and len(blocks) < need:
                why = f"the decode server reserved {len(blocks)} blocks, the prompt needs {need}"
        except (KeyError, TypeError, ValueError) as e:
            why = f"malformed reservation: {e!r}"
        if why is not None:
            self._send(peer, {"type": "failed", "room": room, "error": why})
            self._fail(req, f"transfer refused: {why}")
            return
        self.active[room] = _Outgoing(req, peer, session, layout, blocks, slot)
        self.by_req[id(req)] = room
        self.engine.scheduler.add(req)

    def after_forward(self, batch: ScheduledBatch) -> None:
        """Writes each request's newly complete blocks; after its last prompt chunk the rest
        and its state (final only now)."""
        bs = self.engine.blocks.block_size
        for req in batch.reqs:
            room = self.by_req.get(id(req))
            if room is None:
                continue
            out = self.active[room]
            prompt = len(req.prompt_ids)
            final = req.num_computed_tokens >= prompt
            done = self.engine.blocks.blocks_needed(prompt) if final \
                else req.num_computed_tokens // bs
            if done <= out.sent and not final:
                continue
            todo = spans(self.layout, out.layout, req.block_ids[out.sent:done],
                         out.blocks[out.sent:done], req.state_slot if final else None,
                         out.slot if final else None)
            start = time.perf_counter()
            try:
                self.transfer.write(out.session, todo)
            except (ConnectionError, ValueError) as e:
                del self.active[room]
                self.by_req.pop(id(req), None)
                self._send(out.peer, {"type": "failed", "room": room, "error": str(e)})
                self._fail(req, f"transfer to the decode server failed: {e}")
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
            top = req.logprobs[-1] if req.params.logprobs is not None and req.logprobs else None
            gen = req.generator
            self._send(out.peer, {
                "type": "done", "room": room, "token": req.output_ids[0],
                "logprob": req.cumulative_logprob if top is not None else None,
                "top": [[t, lp] for t, lp in top.items()] if top is not None else None,
                "generator": base64.b64encode(gen.get_state().numpy().tobytes()).decode()
                if gen is not None else None,
                "cached": req.num_cached_prompt, "prompt_hash": prompt_hash(req.prompt_ids)})
            self.counters["pd_transfers"] += 1
            if not req.is_finished:
                self.engine.scheduler.finish(req, "length")

    def held(self) -> tuple[list[int], list[int]]:
        return [], []  # the prefill side holds nothing outside the scheduler

    def close(self) -> None:
        self.sock.close(linger=0)
        self.transfer.unregister_all()


@dataclass(slots=True)
class _Incoming:
    """Decode side: a reservation sent to a prefill server."""

    req: Request | None  # None once the request is gone (a cancel awaiting confirmation)
    peer: tuple[str, int]
    blocks: list[int]
    slot: int
    since: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class _Peer:
    sock: zmq.Socket
    last_heard: float = field(default_factory=time.monotonic)
    last_ping: float = 0.0


class DecodeSide(_Side):
    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(engine)
        self.pending: deque[tuple[Request, float]] = deque()  # not yet reserved
        self.inflight: dict[int, _Incoming] = {}  # room -> reservation
        self.peers: dict[tuple[str, int], _Peer] = {}

    def add(self, req: Request) -> None:
        room = req.params.bootstrap.room  # type: ignore[union-attr]
        if room in self.inflight or any(r.params.bootstrap.room == room  # type: ignore
                                        for r, _ in self.pending):
            raise ValueError(f"bootstrap_room {room} is already in use")
        self.pending.append((req, time.monotonic()))

    def busy(self) -> bool:
        return bool(self.pending or self.inflight)

    def sockets(self) -> list[zmq.Socket]:
        return [p.sock for p in self.peers.values()]

    def held(self) -> tuple[list[int], list[int]]:
        return ([b for r in self.inflight.values() for b in r.blocks],
                [r.slot for r in self.inflight.values()])

    def abort(self, req: Request) -> None:
        self.pending = deque((r, t) for r, t in self.pending if r is not req)
        for room, inc in self.inflight.items():
            if inc.req is req:  # memory stays reserved until the prefill side confirms
                inc.req = None
                self._send(inc.peer, {"type": "cancel", "room": room})

    def _peer(self, key: tuple[str, int]) -> _Peer:
        if key not in self.peers:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{key[0]}:{key[1]}")
            self.peers[key] = _Peer(sock)
        return self.peers[key]

    def _send(self, key: tuple[str, int], msg: dict[str, Any]) -> None:
        try:
            self._peer(key).sock.send(zmq.utils.jsonapi.dumps(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.warning("bootstrap %s:%d: send failed: %s", *key, e)

    def poll(self) -> list[Request]:
        """Reserves memory for pending requests, handles the prefill servers' messages and
        the timeouts; returns the requests whose caches arrived, now running."""
        self._reserve()
        arrived: list[Request] = []
        now = time.monotonic()
        for key, peer in list(self.peers.items()):
            while peer.sock.poll(0):
                peer.last_heard = now
                try:
                    msg = zmq.utils.jsonapi.loads(peer.sock.recv())
                    kind, room = msg["type"], int(msg.get("room", 0))
                except (ValueError, KeyError, TypeError):
                    logger.warning("bootstrap %s:%d: malformed message dropped", *key)
                    continue
                inc = self.inflight.get(room)
                if kind == "pong" or inc is None or inc.peer != key:
                    continue
                if kind == "done":
                    req = self._done(room, msg)
                    if req is not None:
                        arrived.append(req)
                elif kind in ("failed", "cancelled"):
                    self._drop(room, f"the prefill server failed the transfer: "
                                     f"{msg.get('error', '?')}" if kind == "failed" else None)
        for key, peer in list(self.peers.items()):
            rooms = [room for room, inc in self.inflight.items() if inc.peer == key]
            if not rooms:
                continue
            if now - peer.last_heard > self.liveness_s and \
                    all(now - self.inflight[r].since > self.liveness_s for r in rooms):
                for room in rooms:
                    self._drop(room, f"the prefill server {key[0]}:{key[1]} did not answer for "
                                     f"{self.liveness_s:g} s (gone?)")
                peer.sock.close(linger=0)
                del self.peers[key]
                continue
            if now - peer.last_ping > PING_S:
                peer.last_ping = now
                self._send(key, {"type": "ping"})
        for room, inc in list(self.inflight.items()):
            if inc.req is not None and now - inc.since > self.timeout_s:
                self._fail(inc.req, f"the prefill server sent nothing for bootstrap_room {room} "
                                    f"within {self.timeout_s:g} s")
                self.abort(inc.req)
        return arrived

    def _reserve(self) -> None:
        e = self.engine
        sched, blocks, states, cache = e.scheduler, e.blocks, e.states, e.cache
        now = time.monotonic()
        while self.pending:
            req, since = self.pending[0]
            if now - since > self.timeout_s:
                self.pending.popleft()
                self._fail(req, f"no memory to receive the request within {self.timeout_s:g} s")
                continue
            if len(sched.running) + len(self.inflight) >= sched.max_num_seqs:
                return
            need = blocks.blocks_needed(len(req.prompt_ids))
            if need > blocks.num_free and cache is not None:
                cache.evict_blocks(need - blocks.num_free)
            if states.num_free == 0 and cache is not None:
                cache.evict_snapshots(1)
            if need > blocks.num_free or states.num_free == 0:
                return
            self.pending.popleft()
            b = req.params.bootstrap
            assert b is not None
            inc = _Incoming(req, (b.host, b.port), blocks.allocate(need),
                            states.allocate(zero=False))
            self.inflight[b.room] = inc
            self._send(inc.peer, {
                "type": "reserve", "room": b.room, "session": self.transfer.session_id,
                "layout": self.layout.to_dict(), "blocks": inc.blocks, "slot": inc.slot,
                "prompt_len": len(req.prompt_ids), "prompt_hash": prompt_hash(req.prompt_ids)})

    def _drop(self, room: int, why: str | None) -> None:
        """Frees a reservation (the prefill side will not write into it any more) and fails
        its request, if it still has one, with `why`."""
        inc = self.inflight.pop(room)
        self.engine.blocks.free(inc.blocks)
        self.engine.states.free(inc.slot)
        if inc.req is not None and why is not None:
            self._fail(inc.req, why)

    def _done(self, room: int, msg: dict[str, Any]) -> Request | None:
        inc = self.inflight[room]
        req = inc.req
        if req is None:  # cancelled here meanwhile: nothing more will be written
            self._drop(room, None)
            return None
        try:
            token = int(msg["token"])
            if msg["prompt_hash"] != prompt_hash(req.prompt_ids):
                raise ValueError("the prefill server computed another prompt")
            if not 0 <= token < self.engine.model_config.vocab_size:
                raise ValueError(f"first token {token} outside the vocabulary")
            top = {int(t): float(lp) for t, lp in msg["top"]} if msg.get("top") else None
            if msg.get("generator") and req.generator is not None:
                state = base64.b64decode(msg["generator"])
                req.generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            self._drop(room, f"bad transfer from the prefill server: {e}")
            return None
        del self.inflight[room]
        req.block_ids, req.state_slot = inc.blocks, inc.slot
        req.num_computed_tokens = len(req.prompt_ids)
        req.num_cached_prompt = int(msg.get("cached", 0))
        req.status = RequestStatus.RUNNING
        self.engine.scheduler.running.append(req)
        self.counters["pd_transfers"] += 1
        self.engine.append_token(req, token, msg.get("logprob"), top)
        return req

    def close(self) -> None:
        for peer in self.peers.values():
            peer.sock.close(linger=0)
        self.transfer.unregister_all()


def make_side(engine: LLMEngine) -> PrefillSide | DecodeSide | None:
    mode = engine.config.disaggregation_mode
    if mode is None:
        return None
    return PrefillSide(engine) if mode == "prefill" else DecodeSide(engine)
