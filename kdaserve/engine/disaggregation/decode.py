"""The decode server's side: reserving memory for each request, sending the reservation to
its prefill server, and running the request from its first token once the caches are in."""

from __future__ import annotations

import base64
import ipaddress
import logging
import re
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from kdaserve.engine.disaggregation.side import (
    PING_S,
    Side,
    SideHost,
    decode,
    encode,
    integer,
    number,
    prompt_hash,
)
from kdaserve.request import Request

logger = logging.getLogger("kdaserve")

HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")


def check_host(host: str) -> None:
    """A bootstrap host must be a hostname or an IP address (not a ZeroMQ wildcard)."""
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    if not HOSTNAME.match(host):
        raise ValueError(f"bootstrap_host {host!r} is not a hostname or IP address")


@dataclass(slots=True)
class Incoming:
    """A reservation sent to a prefill server."""

    req: Request | None  # None once the request is gone (a cancel awaiting confirmation)
    peer: tuple[str, int]
    tid: str  # echoed by the prefill side in every reply
    blocks: list[int]
    slot: int
    since: float = field(default_factory=time.monotonic)
    cancel_since: float | None = None


@dataclass(slots=True)
class Peer:
    sock: zmq.Socket
    last_ping: float = 0.0
    unanswered: float | None = None  # when the oldest ping still unanswered went out


class DecodeSide(Side):
    def __init__(self, host: SideHost) -> None:
        super().__init__(host)
        self.pending: deque[tuple[Request, float]] = deque()  # not yet reserved
        self.inflight: dict[int, Incoming] = {}  # room -> reservation
        self.peers: dict[tuple[str, int], Peer] = {}

    def sockets(self) -> list[zmq.Socket]:
        return [p.sock for p in self.peers.values()]

    def busy(self) -> bool:
        return bool(self.pending or self.inflight)

    def held(self) -> tuple[list[int], list[int]]:
        return ([b for r in self.inflight.values() for b in r.blocks],
                [r.slot for r in self.inflight.values()])

    def add(self, req: Request) -> None:
        b = req.options.bootstrap
        assert b is not None  # checked by the engine
        check_host(b.host)
        if b.room in self.inflight or any(r.options.bootstrap.room == b.room  # type: ignore
                                          for r, _ in self.pending):
            raise ValueError(f"bootstrap_room {b.room} is already in use")
        self._peer((b.host, b.port))  # connects now: a bad address is this request's 400
        self.pending.append((req, time.monotonic()))

    def abort(self, req: Request) -> None:
        self.pending = deque((r, t) for r, t in self.pending if r is not req)
        for room, inc in self.inflight.items():
            if inc.req is req:  # memory stays reserved until the prefill side confirms
                inc.req, inc.cancel_since = None, time.monotonic()
                self._send(inc.peer, {"type": "cancel", "room": room, "tid": inc.tid})

    def _peer(self, key: tuple[str, int]) -> Peer:
        if key not in self.peers:
            sock = self.socket(zmq.DEALER)
            try:
                sock.connect(f"tcp://{key[0]}:{key[1]}")
            except zmq.ZMQError as e:
                sock.close(linger=0)
                raise ValueError(f"cannot reach bootstrap {key[0]}:{key[1]}: {e}") from None
            self.peers[key] = Peer(sock)
        return self.peers[key]

    def _send(self, key: tuple[str, int], msg: dict[str, Any]) -> None:
        try:
            self._peer(key).sock.send(encode(msg), zmq.NOBLOCK)
        except (zmq.ZMQError, ValueError) as e:
            logger.warning("bootstrap %s:%d: send failed: %s", *key, e)

    def poll(self) -> list[Request]:
        """Reserves memory for pending requests, handles the prefill servers' messages,
        liveness and timeouts; returns the requests whose caches arrived, now running."""
        self._reserve()
        arrived: list[Request] = []
        for key, peer in list(self.peers.items()):
            while peer.sock.poll(0):
                peer.unanswered = None  # any message proves the peer alive
                try:
                    msg = decode(peer.sock.recv())
                    req = self._handle(key, msg)
                except (ValueError, KeyError, TypeError, OverflowError) as e:
                    logger.warning("bootstrap %s:%d: malformed message dropped: %s", *key, e)
                    continue
                if req is not None:
                    arrived.append(req)
        self._liveness()
        return arrived

    def _handle(self, key: tuple[str, int], msg: dict[str, Any]) -> Request | None:
        if msg["type"] == "pong":
            return None
        room = integer(msg, "room")
        inc = self.inflight.get(room)
        if inc is None or inc.peer != key or msg.get("tid") != inc.tid:
            return None  # a reply to a reservation that is gone
        kind = msg["type"]
        if kind == "done":
            return self._done(room, msg)
        if kind == "failed":
            self._drop(room, f"the prefill server failed the transfer: {msg.get('error')}")
        elif kind == "cancelled":
            self._drop(room, "the prefill server cancelled the transfer")
        return None

    def _liveness(self) -> None:
        now = time.monotonic()
        for key, peer in list(self.peers.items()):
            rooms = [room for room, inc in self.inflight.items() if inc.peer == key]
            if not rooms:
                if not any((r.options.bootstrap.host, r.options.bootstrap.port) == key  # type: ignore
                           for r, _ in self.pending):
                    peer.sock.close(linger=0)
                    del self.peers[key]
                continue
            if peer.unanswered is not None and now - peer.unanswered > self.liveness_s:
                for room in rooms:  # best effort, in case it is only slow
                    self._send(key, {"type": "cancel", "room": room,
                                     "tid": self.inflight[room].tid})
                    self._drop(room, f"the prefill server {key[0]}:{key[1]} did not answer "
                                     f"for {self.liveness_s:g} s (gone?)")
                peer.sock.close(linger=0)
                del self.peers[key]
                continue
            if now - peer.last_ping > PING_S:
                peer.last_ping = now
                if peer.unanswered is None:
                    peer.unanswered = now
                self._send(key, {"type": "ping"})
                for room in rooms:  # cancels are resent until confirmed
                    inc = self.inflight[room]
                    if inc.req is None:
                        self._send(key, {"type": "cancel", "room": room, "tid": inc.tid})
        for room, inc in list(self.inflight.items()):
            if inc.req is not None and now - inc.since > self.timeout_s:
                self.fail(inc.req, f"the prefill server sent nothing for bootstrap_room {room} "
                                   f"within {self.timeout_s:g} s")
                self.abort(inc.req)
            elif inc.cancel_since is not None and \
                    now - inc.cancel_since > self.timeout_s + self.liveness_s:
                logger.error("bootstrap_room %d: a cancel never confirmed by a live prefill "
                             "server; its reservation is freed", room)
                self._drop(room, None)

    def _reserve(self) -> None:
        e = self.host
        sched, blocks, states, cache = e.scheduler, e.blocks, e.states, e.cache
        now = time.monotonic()
        while self.pending:
            req, since = self.pending[0]
            if now - since > self.timeout_s:
                self.pending.popleft()
                self.fail(req, f"no memory to receive the request within {self.timeout_s:g} s")
                continue
            if len(sched.running) + len(self.inflight) >= sched.max_num_seqs:
                return
            need = blocks.blocks_needed(len(req.prompt_ids))
            sched.make_room(need)
            if states.num_free == 0 and cache is not None:
                cache.evict_snapshots(1)
            if need > blocks.num_free or states.num_free == 0:
                return
            self.pending.popleft()
            b = req.options.bootstrap
            assert b is not None
            # the slot is zeroed: nothing of an earlier request shows through if a peer
            # claims "done" without writing
            inc = Incoming(req, (b.host, b.port), secrets.token_hex(8), blocks.allocate(need),
                           states.allocate())
            self.inflight[b.room] = inc
            self._send(inc.peer, {
                "type": "reserve", "room": b.room, "tid": inc.tid,
                "session": self.transfer.session_id, "layout": self.layout.to_dict(),
                "blocks": inc.blocks, "slot": inc.slot, "liveness_s": self.liveness_s,
                "prompt_len": len(req.prompt_ids), "prompt_hash": prompt_hash(req.prompt_key)})

    def _drop(self, room: int, why: str | None) -> None:
        """Frees a reservation (the prefill side will not write into it any more) and fails
        its request, if it still has one, with `why`."""
        inc = self.inflight.pop(room)
        self.host.blocks.free(inc.blocks)
        self.host.states.free(inc.slot)
        if inc.req is not None and why is not None:
            self.fail(inc.req, why)

    def _done(self, room: int, msg: dict[str, Any]) -> Request | None:
        inc = self.inflight[room]
        req = inc.req
        if req is None:  # cancelled here meanwhile: nothing more will be written
            self._drop(room, None)
            return None
        try:
            token = integer(msg, "token")
            if msg.get("prompt_hash") != prompt_hash(req.prompt_key):
                raise ValueError("the prefill server computed another prompt")
            if not 0 <= token < self.host.model_config.vocab_size:
                raise ValueError(f"first token {token} outside the vocabulary")
            top = {int(t): number(lp) for t, lp in msg["top"]} if msg.get("top") else None
            logprob = number(msg["logprob"]) if top is not None else None
            cached = integer(msg, "cached", 0)
            if msg.get("generator") and req.generator is not None:
                state = base64.b64decode(msg["generator"], validate=True)
                req.generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        except (KeyError, TypeError, ValueError, RuntimeError, OverflowError) as e:
            self._drop(room, f"bad transfer from the prefill server: {e}")
            return None
        del self.inflight[room]
        req.block_ids, req.state_slot = inc.blocks, inc.slot
        req.num_computed_tokens = len(req.prompt_ids)
        req.num_cached_prompt = cached
        self.host.scheduler.add_running(req)
        self.counters["pd_transfers"] += 1
        self.host.out.append_token(req, token, logprob, top)
        return req
