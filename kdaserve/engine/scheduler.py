"""Scheduler: which requests run how many tokens this step, within the token budget and pools.

Policy (continuous batching, chunked prefill, recompute preemption):
1. Running requests, oldest first: decodes take one token, unfinished prefills the next chunk.
   A request that needs a block when none is free preempts the newest running request (its
   blocks and state slot are freed; it restarts from scratch later, prompt + output so far).
2. Waiting requests, FCFS, while the budget, `max_num_seqs`, a state slot and the blocks for
   their first chunk are available. No skipping ahead: the head of the queue is never starved.
A request that could not fit even in an empty pool is rejected when it is added.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kdaserve.cache.block_pool import BlockPool
from kdaserve.cache.state_pool import StatePool
from kdaserve.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledBatch:
    reqs: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.reqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, blocks: BlockPool, states: StatePool, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        self.blocks, self.states = blocks, states
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ---- queue management ----
    def max_request_tokens(self) -> int:
        return self.blocks.num_blocks * self.blocks.block_size

    def add(self, req: Request) -> None:
        need = len(req.prompt_ids) + req.params.max_tokens
        if need > self.max_request_tokens():
            raise ValueError(
                f"request needs up to {need} tokens (prompt {len(req.prompt_ids)} + max_tokens "
                f"{req.params.max_tokens}) but the whole KV cache holds "
                f"{self.max_request_tokens()}; lower max_tokens or raise max_total_tokens")
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def finish(self, req: Request, reason: str) -> None:
        """Marks a request finished and returns its blocks and state slot."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _release(self, req: Request) -> None:
        if req.block_ids:
            self.blocks.free(req.block_ids)
            req.block_ids = []
        if req.state_slot is not None:
            self.states.free(req.state_slot)
            req.state_slot = None
        req.num_computed_tokens = 0

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Ensures req's block table covers num_tokens; False if the pool is short."""
        need = self.blocks.blocks_needed(num_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        if need > self.blocks.num_free:
            return False
        req.block_ids.extend(self.blocks.allocate(need))
        return True

    # ---- the policy ----
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        # decodes before prefill chunks, so a long prompt never stalls running streams
        order = sorted(self.running, key=lambda r: (r.is_prefilling, r.arrival))
        scheduled: set[int] = set()
        for req in order:
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self._grow(req, req.num_computed_tokens + n):
                victims = [r for r in self.running if id(r) not in scheduled]
                victim = max(victims, key=lambda r: r.arrival)
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            scheduled.add(id(req))
            batch.reqs.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and self.states.num_free > 0):
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._grow(req, req.num_computed_tokens + n):
                break
            self.waiting.popleft()
            req.state_slot = self.states.allocate()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.reqs.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def check_integrity(self) -> None:
        """Pools consistent with the requests holding them."""
        self.blocks.check_integrity()
        self.states.check_integrity()
        held_blocks = [b for r in self.running for b in r.block_ids]
        held_slots = [r.state_slot for r in self.running]
        assert len(held_slots) == len(set(held_slots)), "state slot shared by two requests"
        assert None not in held_slots, "running request without a state slot"
        assert all(not r.block_ids and r.state_slot is None for r in self.waiting), \
            "waiting request holds resources"
        assert len(held_slots) == self.states.num_slots - self.states.num_free, "slot leak"
        counts: dict[int, int] = {}
        for b in held_blocks:
            counts[b] = counts.get(b, 0) + 1
        for b in range(self.blocks.num_blocks):
            assert self.blocks.refcount[b] == counts.get(b, 0), f"block {b} refcount mismatch"
