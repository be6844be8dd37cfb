"""Scheduler: which requests run how many tokens this step, within the token budget and pools.

Policy (continuous batching, chunked prefill, recompute preemption):
1. Running requests, oldest first: decodes take one token, unfinished prefills the next chunk.
   A request that needs a block when none is free (after evicting unused prefix-cache blocks)
   preempts the newest running request (its blocks and state slot are freed; it restarts later
   from prompt + output so far, usually from its own cached prefix).
2. Waiting requests while the budget, `max_num_seqs`, a state slot and the blocks for their
   first chunk are available: with the prefix cache, longest cached prefix first (FCFS beyond
   LPM_MAX_QUEUE waiting requests, where matching everything costs too much); no skipping
   ahead of a head that does not fit.
A request that could not fit even in an empty pool is rejected when it is added.

Prefix cache: an admitted request resumes from the deepest cached snapshot of its prefix (KV
blocks shared, the snapshot *copied* into its own slot), and prefill chunks are cut at the
positions where it should leave snapshots for later requests (`snapshot_points`).
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from kdaserve.cache.block_pool import BlockPool
from kdaserve.cache.radix_cache import RadixCache
from kdaserve.cache.state_pool import StatePool
from kdaserve.engine.prefill_budget import PrefillBudget
from kdaserve.request import Request, RequestStatus
from kdaserve.scheduled_batch import ScheduledBatch

LPM_MAX_QUEUE = 128
DEDUP_LEADERS = 16  # prefilling requests a waiting one is compared with for in-batch dedup
# Evictions free this fraction of the block pool (of the snapshot cap) beyond what is asked:
# each walks the whole tree, and freeing exactly what one request needs left the pool full,
# so every later block (a decode crossing a block boundary) or snapshot walked it again
# (~1.4 ms at 2,300 cached nodes; the hidden-256 MoE's decode steps ~20% slower).
BLOCK_HEADROOM, SNAPSHOT_HEADROOM = 1 / 128, 1 / 16


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of a and b, at most `limit`: compared in C-speed slices
    (n siblings of a 30k-token prompt are compared with their leader every step)."""
    n, step = 0, 512
    while n < limit:
        m = min(step, limit - n)
        if a[n:n + m] == b[n:n + m]:
            n += m
            continue
        while n < limit and a[n] == b[n]:
            n += 1
        break
    return n


class RequestHooks(Protocol):
    """Told when a request enters or leaves the running batch (a drafter's per-request state
    follows the request's caches)."""

    def on_admit(self, req: Request) -> None: ...
    def on_release(self, req: Request) -> None: ...  # before its blocks are freed
    def on_finish(self, req: Request) -> None: ...
    def on_abort(self, req: Request) -> None: ...
    def on_preempt(self, req: Request) -> None: ...


class Scheduler:
    def __init__(self, blocks: BlockPool, states: StatePool, max_num_seqs: int,
                 max_num_batched_tokens: int, cache: RadixCache | None = None,
                 snapshot_interval: int = 64, max_snapshots: int = 0,
                 prefill_snapshot_stride: int = 0,
                 max_prefill_tokens_with_decodes: int | None = None) -> None:
        self.blocks, self.states, self.cache = blocks, states, cache
        self.snapshot_interval = snapshot_interval
        self.prefill_snapshot_stride = prefill_snapshot_stride
        self.max_snapshots = max_snapshots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_tokens_with_decodes = max_prefill_tokens_with_decodes
        self.itl_budget: PrefillBudget | None = None  # set by an engine with an ITL target
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._in_flight: list[tuple[Request, int, int]] = []  # planned in-chunk snapshots
        self.num_preemptions = 0
        self.hooks: RequestHooks | None = None

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

    def add_running(self, req: Request) -> None:
        """A request whose prompt was computed elsewhere, its blocks and state slot filled by
        a transfer (a decode server's arrival): it decodes from the next step."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def finish(self, req: Request, reason: str) -> None:
        """Marks a request finished and returns its blocks and state slot (its computed
        prefix and latest decode snapshot go to the prefix cache first)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._cache_request(req)
        self._release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if self.hooks is not None:
            (self.hooks.on_abort if reason == "abort" else self.hooks.on_finish)(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _release(self, req: Request) -> None:
        if self.hooks is not None and req.block_ids:
            self.hooks.on_release(req)
        if req.cache_node is not None:
            assert self.cache is not None
            self.cache.unlock(req.cache_node)
            req.cache_node = None
        if req.track_slot is not None:
            self.states.free(req.track_slot)
            req.track_slot = None
        req.snapshot_points = []
        req.draft_ids = []
        if req.block_ids:
            self.blocks.free(req.block_ids)
            req.block_ids = []
        if req.state_slot is not None:
            self.states.free(req.state_slot)
            req.state_slot = None
        req.num_computed_tokens = 0

    def retract_all(self) -> None:
        """Every running request back to the queue, its memory freed (it is recomputed when
        it runs again; RL's pause in retract mode)."""
        for req in sorted(self.running, key=lambda r: r.arrival, reverse=True):
            self._preempt(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._cache_request(req)
        self._release(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        if self.hooks is not None:
            self.hooks.on_preempt(req)

    def make_room(self, num_blocks: int) -> None:
        """Evicts cached blocks (with BLOCK_HEADROOM) until num_blocks are free, if it can."""
        if num_blocks > self.blocks.num_free and self.cache is not None:
            self.cache.evict_blocks(num_blocks - self.blocks.num_free
                                    + int(self.blocks.num_blocks * BLOCK_HEADROOM))

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Ensures req's block table covers num_tokens; False if the pool is short."""
        need = self.blocks.blocks_needed(num_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        self.make_room(need)
        if need > self.blocks.num_free:
            return False
        req.block_ids.extend(self.blocks.allocate(need))
        return True

    # ---- the policy ----
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        # decodes before prefill chunks, so a long prompt never stalls running streams; while
        # some decode, prompts get a smaller budget (_prefill_budget)
        order = sorted(self.running, key=lambda r: (r.is_prefilling, r.arrival))
        prefill_budget: int | None = None  # set at the first prompt: decodes come first
        scheduled: set[int] = set()
        for req in order:
            prefilling = req.is_prefilling
            if prefilling and prefill_budget is None:
                prefill_budget = self._prefill_budget(self.max_num_batched_tokens - budget)
            if budget == 0 or (prefilling and prefill_budget == 0):
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            if req.ends_when_read:
                continue
            n = self._chunk(req, min(budget, prefill_budget) if prefill_budget is not None
                            and prefilling else budget)
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
            if prefilling and prefill_budget is not None:
                prefill_budget -= n
        if prefill_budget is None:
            prefill_budget = self._prefill_budget(self.max_num_batched_tokens - budget)
        self._order_waiting()
        # admission pops from the front and stops at the first request that does not fit:
        # O(admitted) a step, whatever the queue's length (thousands of n > 1 siblings)
        deferred: list[Request] = []
        while self.waiting:
            if min(budget, prefill_budget) == 0 or len(self.running) >= self.max_num_seqs:
                break
            req = self.waiting.popleft()
            if req.ends_when_read or self._defer_for_shared_prefix(req, batch):
                deferred.append(req)
                continue
            if self.states.num_free == 0 and not (self.cache and self.cache.evict_snapshots(1)):
                self.waiting.appendleft(req)
                break
            req.state_slot = self.states.allocate()
            self._resume_from_cache(req)
            n = self._chunk(req, min(budget, prefill_budget))
            if not self._grow(req, req.num_computed_tokens + n):
                self._release(req)  # back to waiting untouched: cache refs, slot, blocks
                self.waiting.appendleft(req)
                break
            if self.cache is not None:
                self.cache.queried_tokens += len(req.prompt_ids)
                self.cache.hit_tokens += min(req.num_cached_prompt, len(req.prompt_ids))
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if self.hooks is not None:
                self.hooks.on_admit(req)
            batch.reqs.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
            prefill_budget -= n
        self.waiting.extendleft(reversed(deferred))  # in their places, at the front
        self._plan_snapshots(batch)
        return batch

    def _prefill_budget(self, decode_tokens: int) -> int:
        """Prompt tokens this step may take, decode_tokens already scheduled (each decoding
        stream waits for the whole step, so while some decode, prompts are capped: by the
        fixed cap and by the ITL target's fitted budget, whichever is lower). Decodes this
        step actually runs count, not running ones it skips (read-pending on CUDA's overlap,
        or preempted a moment ago): a step without them stalls no stream."""
        cap = self.max_num_batched_tokens
        if decode_tokens:
            if self.max_prefill_tokens_with_decodes is not None:
                cap = min(cap, self.max_prefill_tokens_with_decodes)
            fitted = self.itl_budget.tokens(decode_tokens) if self.itl_budget else None
            if fitted is not None:
                cap = min(cap, fitted)
        return cap

    # ---- prefix cache ----
    def _order_waiting(self) -> None:
        """Longest cached prefix first (a stable sort: FCFS among equals); preempted requests
        keep their place at the front."""
        if self.cache is None or not 1 < len(self.waiting) <= LPM_MAX_QUEUE:
            return
        cache = self.cache

        def key(r: Request) -> tuple[int, int]:
            # matched once per request: re-matching every waiting prompt every step costs
            # O(queued tokens) a step; a stale hint only reorders, never changes results
            if r.prefix_hint is None:
                r.prefix_hint = cache.match(r.key_ids[:r.max_cached_prefix],
                                            touch=False).num_tokens
            return (0 if r.num_preemptions else 1, -r.prefix_hint)

        self.waiting = deque(sorted(self.waiting, key=key))

    def _defer_for_shared_prefix(self, req: Request, batch: ScheduledBatch) -> bool:
        """In-batch dedup: a request sharing a long prefix with one still prefilling waits
        until that one has snapshotted the shared part (the leader is told to snapshot there),
        then resumes from it instead of computing the same prefix twice."""
        if self.cache is None or req.num_preemptions or \
                req.max_cached_prefix < req.num_tokens - 1:  # rows it must run itself
            return False
        grid = self.snapshot_interval
        ids = req.key_ids
        hit: int | None = None  # matched only when some leader shares a grid's worth
        for leader in self.running[-DEDUP_LEADERS:]:
            if not leader.is_prefilling:
                continue
            other = leader.key_ids
            shared = common_prefix(ids, other, min(len(ids) - 1, len(other)))
            point = shared // grid * grid
            if point < grid or point <= leader.num_computed_tokens:
                continue
            if hit is None:
                hit = self.cache.match(ids[:-1], touch=False).num_tokens
            if point - hit >= grid:
                if point not in leader.snapshot_points:
                    leader.snapshot_points = sorted([*leader.snapshot_points, point])
                # a leader already scheduled past the point this step stops there instead
                if leader in batch.reqs:
                    i = batch.reqs.index(leader)
                    start = leader.num_computed_tokens
                    if start + batch.num_new_tokens[i] > point:
                        batch.num_new_tokens[i] = point - start
                return True
        return False

    def _resume_from_cache(self, req: Request) -> None:
        """Takes the deepest cached snapshot of req's prefix: shares its blocks, copies the
        state into req's fresh slot (copy-on-write), and plans where req leaves snapshots."""
        if self.cache is None:
            return
        ids = req.key_ids
        m = self.cache.match(ids[:req.max_cached_prefix])
        if m.num_tokens:
            self.blocks.share(m.blocks)
            req.block_ids = list(m.blocks)
            req.num_computed_tokens = m.num_tokens
            assert m.node.state_slot is not None and req.state_slot is not None
            self.states.copy(m.node.state_slot, req.state_slot)
        req.num_cached_prompt = m.num_tokens
        req.cache_node = m.node
        self.cache.lock(m.node)
        grid, bs = self.snapshot_interval, self.blocks.block_size
        # where a later request forking from the same prefix would want to resume, and the
        # last block boundary before the end of what we have (identical prompts then hit)
        points = {m.branch_len // grid * grid, (len(ids) - 1) // bs * bs}
        # and every stride: a request that arrives after this one has prefilled, and forks
        # inside its prompt where no fork was known yet, resumes at most a stride back (the
        # server's requests arrive one by one, so in-batch dedup rarely sees them together)
        if self.prefill_snapshot_stride:
            points.update(range(self.prefill_snapshot_stride, len(ids) - 1,
                                self.prefill_snapshot_stride))
        req.snapshot_points = sorted(p for p in points if p > req.num_computed_tokens)

    def _chunk(self, req: Request, budget: int) -> int:
        """Tokens to run now: the budget (snapshot points inside it do not cut the chunk: the
        kernels take those snapshots, see `_plan_snapshots`); a decode with drafts runs its
        last token and the drafts (as many as the budget allows)."""
        start = req.num_computed_tokens
        if req.draft_ids and req.num_tokens - start == 1:
            del req.draft_ids[max(budget - 1, 0):]
            return min(1 + len(req.draft_ids), budget)
        return min(req.num_tokens - start, budget)

    def _plan_snapshots(self, batch: ScheduledBatch) -> None:
        """Snapshot points strictly inside a chunk get a slot now; the forward fills it and
        `insert_snapshots` hands it to the tree. (A point at the chunk's end is taken after
        the step by `take_snapshots`, as before.)"""
        self._in_flight = batch.snapshots  # slots owned by no one until insert_snapshots
        if self.cache is None:
            return
        for req, n in zip(batch.reqs, batch.num_new_tokens, strict=True):
            start = req.num_computed_tokens
            for p in [p for p in req.snapshot_points if start < p < start + n]:
                slot = self._snapshot_slot()
                if slot is None:
                    return
                req.snapshot_points.remove(p)
                batch.snapshots.append((req, p, slot))

    def insert_snapshots(self, batch: ScheduledBatch) -> None:
        """After the forward, before any request of the batch can finish: the planned
        in-chunk snapshots go to the tree (which frees a slot it already has one for)."""
        for req, p, slot in batch.snapshots:
            assert self.cache is not None  # only planned with a cache
            if self.cache.insert(req.key_ids[:p], req.block_ids, slot):
                self._cap_snapshots()
        self._in_flight = []

    def take_snapshots(self, reqs: list[Request]) -> None:
        """After a step: snapshot requests that just reached a planned prefill position, and
        refresh the decode track copy at grid boundaries."""
        if self.cache is None:
            return
        for req in reqs:
            if req.is_finished or req.state_slot is None:
                continue
            pos = req.num_computed_tokens
            on_grid = pos % self.snapshot_interval == 0
            prefilling = req.is_prefilling
            planned = bool(req.snapshot_points) and pos in req.snapshot_points
            # planned points, and every prefill chunk end on the grid (a long prompt then
            # leaves a checkpoint per chunk, as SGLang caches unfinished requests)
            if planned or (prefilling and on_grid):
                if planned:
                    req.snapshot_points.remove(pos)
                slot = self._snapshot_slot()
                if slot is not None:
                    self.states.copy(req.state_slot, slot)
                    if self.cache.insert(req.key_ids[:pos], req.block_ids, slot):
                        self._cap_snapshots()
            elif not prefilling and on_grid:
                if req.track_slot is None:
                    req.track_slot = self._snapshot_slot()
                if req.track_slot is not None:
                    self.states.copy(req.state_slot, req.track_slot)
                    req.track_pos = pos

    def _snapshot_slot(self) -> int | None:
        """A slot for a snapshot or a decode-track copy. The cap on cached snapshots is applied
        once one is kept (`_cap_snapshots`): a track copy is not in the tree, and a snapshot
        the tree already has is refused, so evicting for either would only thin the cache."""
        assert self.cache is not None
        if self.max_snapshots <= 0:
            return None
        if self.states.num_free == 0 and not self.cache.evict_snapshots(1):
            return None
        return self.states.allocate(zero=False)

    def _cache_request(self, req: Request) -> None:
        """Hands a leaving request's computed full blocks, and its decode snapshot, to the
        cache (so a preempted request or the next chat turn resumes from them)."""
        if self.cache is None or req.state_slot is None:
            return
        bs = self.blocks.block_size
        full = req.num_computed_tokens // bs * bs
        if full:
            self.cache.insert(req.key_ids[:full], req.block_ids)
        if req.track_slot is not None and 0 < req.track_pos <= req.num_computed_tokens:
            if self.cache.insert(req.key_ids[:req.track_pos], req.block_ids, req.track_slot):
                self._cap_snapshots()
            req.track_slot = None  # owned (or freed) by the cache now

    def _cap_snapshots(self) -> None:
        """Evicts LRU snapshots beyond max_snapshots (the one just inserted is the newest),
        with SNAPSHOT_HEADROOM."""
        assert self.cache is not None
        excess = self.cache.num_snapshots - max(self.max_snapshots, 0)
        if excess > 0:
            self.cache.evict_snapshots(excess + int(self.max_snapshots * SNAPSHOT_HEADROOM))

    def check_integrity(self, reserved_blocks: list[int] | None = None,
                        reserved_slots: list[int] | None = None) -> None:
        """Pools consistent with the requests holding them (and with what a decode server has
        reserved for transfers in flight)."""
        self.blocks.check_integrity()
        self.states.check_integrity()
        held_blocks = [b for r in self.running for b in r.block_ids] + (reserved_blocks or [])
        work_slots = [r.state_slot for r in self.running]
        assert None not in work_slots, "running request without a state slot"
        held_slots = work_slots + [r.track_slot for r in self.running if r.track_slot is not None]
        held_slots += [slot for _, _, slot in self._in_flight] + (reserved_slots or [])
        if self.cache is not None:
            held_blocks += self.cache.tree_blocks()
            held_slots += self.cache.snapshot_slots()
            self.cache.check_integrity()
            assert self.cache.num_snapshots <= max(self.max_snapshots, 0) + 1
        assert len(held_slots) == len(set(held_slots)), "state slot held twice"
        assert all(not r.block_ids and r.state_slot is None and r.cache_node is None
                   for r in self.waiting), "waiting request holds resources"
        assert len(held_slots) == self.states.num_slots - self.states.num_free, "slot leak"
        counts: dict[int, int] = {}
        for b in held_blocks:
            counts[b] = counts.get(b, 0) + 1
        for b in range(self.blocks.num_blocks):
            assert self.blocks.refcount[b] == counts.get(b, 0), f"block {b} refcount mismatch"
