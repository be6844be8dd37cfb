"""The scheduler's use of the prefix cache, driven by a fake runner (no model; fakes in
radix_fakes.py): resume from snapshots with copy-on-write, chunk cuts at snapshot points,
decode-track snapshots, LPM ordering. Integrity is checked after every step."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from kdaserve.cache.block_pool import BlockPool
from kdaserve.cache.radix_cache import RadixCache
from kdaserve.cache.state_pool import StatePool
from kdaserve.engine.scheduler import LPM_MAX_QUEUE, Scheduler
from kdaserve.request import Request, RequestStatus, SamplingParams
from kdaserve.scheduled_batch import ScheduledBatch

from .radix_fakes import (
    CONFIG,
    FAKE_VOCAB,
    expected_output,
    fake_next_token,
    fake_state,
    find,
    read_state,
    snapshot_depths,
    snapshot_keys,
    tree_paths,
    write_state,
)

# ---- the scheduler with a prefix cache (no model) ----

class FakeEngine:
    """LLMEngine.step's order with a fake runner: schedule, run the batch (token ids into the
    paged cache through the block table, the fake state into the request's slot), take
    snapshots, sample (a hash of the history read back from the cache), finish."""

    def __init__(self, *, num_blocks: int = 64, block_size: int = 16, num_slots: int = 12,
                 max_num_seqs: int = 4, budget: int = 512, snapshot_interval: int = 64,
                 max_snapshots: int = 4) -> None:
        self.blocks = BlockPool(CONFIG, num_blocks, block_size, torch.float32)
        self.states = StatePool(CONFIG, num_slots, torch.float32)
        self.cache = RadixCache(self.blocks, self.states)
        self.scheduler = Scheduler(self.blocks, self.states, max_num_seqs, budget, self.cache,
                                   snapshot_interval=snapshot_interval,
                                   max_snapshots=max_snapshots)
        self.check()

    def check(self) -> None:
        self.scheduler.check_integrity()
        bs = self.blocks.block_size
        for node, path in tree_paths(self.cache).items():
            kv = self.blocks.kv[0, node.blocks, :, 0].flatten().tolist()
            assert [int(t) for t in kv] == list(node.key), \
                f"tree blocks at depth {node.depth} do not hold their tokens"
            assert node.depth % bs == 0
            if node.state_slot is not None:
                assert read_state(self.states, node.state_slot) == fake_state(path), \
                    f"snapshot at depth {node.depth} is not the state after its path"

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> Request:
        req = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens))
        self.scheduler.add(req)
        self.check()
        return req

    def step(self, inspect: Callable[[ScheduledBatch], None] | None = None) -> ScheduledBatch:
        """One engine step; `inspect` sees the scheduled batch before it runs."""
        s, bs = self.scheduler, self.blocks.block_size
        batch = s.schedule()
        self.check()
        if inspect is not None:
            inspect(batch)
        sampled: list[Request] = []
        for req, n in zip(batch.reqs, batch.num_new_tokens, strict=True):
            start = req.num_computed_tokens
            assert req.state_slot is not None and start + n <= req.num_tokens
            assert read_state(self.states, req.state_slot) == fake_state(req.all_ids[:start]), \
                f"{req.rid} does not start from the state after its {start} computed tokens"
            pos = torch.arange(start, start + n)
            table = torch.tensor(req.block_ids, dtype=torch.int64)
            tokens = torch.tensor(req.all_ids[start:start + n], dtype=torch.float32)
            self.blocks.kv[0, table[pos // bs], pos % bs, 0] = tokens
            write_state(self.states, req.state_slot, req.all_ids[:start + n])
            for r, p, slot in batch.snapshots:  # what the KDA kernels write inside a chunk
                if r is req:
                    assert start < p < start + n
                    write_state(self.states, slot, req.all_ids[:p])
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens:
                sampled.append(req)
        s.insert_snapshots(batch)
        s.take_snapshots(batch.reqs)
        self.check()
        for req in sampled:
            pos = torch.arange(req.num_computed_tokens)
            table = torch.tensor(req.block_ids, dtype=torch.int64)
            history = [int(t) for t in self.blocks.kv[0, table[pos // bs], pos % bs, 0].tolist()]
            assert history == req.all_ids, f"{req.rid}: paged cache does not hold its tokens"
            req.output_ids.append(fake_next_token(history))
            if len(req.output_ids) >= req.params.max_tokens:
                s.finish(req, "length")
            self.check()
        return batch

    def run_until_done(self, max_steps: int = 200) -> list[ScheduledBatch]:
        batches = []
        while self.scheduler.has_unfinished():
            assert len(batches) < max_steps, "scheduler made no progress"
            batches.append(self.step())
        return batches

    def chunks_of(self, req: Request, batches: list[ScheduledBatch]) -> list[int]:
        return [n for b in batches
                for r, n in zip(b.reqs, b.num_new_tokens, strict=True) if r is req]


def prompt(seed: str, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(FAKE_VOCAB) for _ in range(n)]


P = prompt("system", 150)


def test_prompt_prefill_snapshots_the_last_block_boundary_inside_its_chunk() -> None:
    eng = FakeEngine()
    a = eng.add("a", P[:100], max_tokens=1)
    batches = eng.run_until_done()
    assert eng.chunks_of(a, batches) == [100], "a snapshot point must not cut the chunk"
    assert [(r.rid, p) for r, p, _ in batches[0].snapshots] == [("a", 96)]
    assert a.output_ids == expected_output(P[:100], 1)
    assert snapshot_depths(eng.cache) == [96]
    assert list(tree_paths(eng.cache).values()) == [tuple(P[:96])]
    assert eng.cache.hit_tokens == 0 and eng.cache.queried_tokens == 100
    # the cache alone holds what is left; it is all evictable
    assert eng.blocks.num_free == eng.blocks.num_blocks - 6
    assert eng.states.num_free == eng.states.num_slots - 1
    assert eng.cache.evictable_blocks() == 6


def test_resumed_request_shares_blocks_and_gets_a_copy_of_the_snapshot() -> None:
    eng = FakeEngine()
    eng.add("a", P[:100], max_tokens=1)
    eng.run_until_done()
    node = find(eng.cache, P[:96])
    assert node is not None and node.state_slot is not None
    snap = node.state_slot
    # recognisable values everywhere except the fake runner's two elements
    pattern = torch.arange(eng.states.recurrent[:, snap].numel(), dtype=torch.float32)
    eng.states.recurrent[:, snap] = pattern.view_as(eng.states.recurrent[:, snap]) + 0.5
    eng.states.conv[:, snap] = -1.25
    write_state(eng.states, snap, P[:96])
    saved = (eng.states.recurrent[:, snap].clone(), eng.states.conv[:, snap].clone())

    b_prompt = P[:96] + prompt("b", 30)
    b = eng.add("b", b_prompt, max_tokens=3)

    def admitted(batch: ScheduledBatch) -> None:
        assert batch.reqs == [b]
        assert b.num_computed_tokens == 96 and b.num_cached_prompt == 96
        assert b.block_ids[:6] == node.blocks, "resumed request does not share the tree's blocks"
        assert all(eng.blocks.refcount[blk] == 2 for blk in node.blocks)
        assert b.cache_node is node and node.lock == 1
        assert b.state_slot is not None and b.state_slot != snap, "request runs on the snapshot"
        assert torch.equal(eng.states.recurrent[:, b.state_slot], saved[0]), "snapshot not copied"
        assert torch.equal(eng.states.conv[:, b.state_slot], saved[1])
        # 125 // 16 * 16, inside the chunk (the grid point 64 is already cached)
        assert [(r.rid, p) for r, p, _ in batch.snapshots] == [("b", 112)]
        assert b.snapshot_points == []
        assert batch.num_new_tokens == [30], "a snapshot point must not cut the chunk"
        # the request's kernels update its slot in place
        eng.states.recurrent[:, b.state_slot] = 9.0
        eng.states.conv[:, b.state_slot] = 9.0
        write_state(eng.states, b.state_slot, b_prompt[:96])

    eng.step(admitted)
    assert eng.cache.hit_tokens == 96 and eng.cache.queried_tokens == 100 + 126
    assert torch.equal(eng.states.recurrent[:, snap], saved[0]), "snapshot written through"
    assert torch.equal(eng.states.conv[:, snap], saved[1])
    batches = eng.run_until_done()
    assert eng.chunks_of(b, batches) == [1, 1] and b.output_ids == expected_output(b_prompt, 3)
    assert snapshot_depths(eng.cache) == [96, 112, 128]  # + b's decode track at 128
    assert node.lock == 0


def test_fork_part_way_into_a_cached_prefix_snapshots_the_branch_point() -> None:
    eng = FakeEngine()
    eng.add("a", P, max_tokens=1)
    eng.run_until_done()
    assert snapshot_depths(eng.cache) == [144]
    # C diverges inside block 8 (tokens 128..144): no snapshot on the way, KV matched to 128
    c_prompt = P[:140] + prompt("c", 20)
    c = eng.add("c", c_prompt, max_tokens=1)
    batches = eng.run_until_done()
    assert c.num_cached_prompt == 0
    assert eng.chunks_of(c, batches) == [160], "a snapshot point must not cut the chunk"
    assert [p for r, p, _ in batches[0].snapshots] == [128, 144], "branch point and 144"
    assert snapshot_depths(eng.cache) == [128, 144, 144]
    branch = find(eng.cache, P[:128])
    assert branch is not None and branch.state_slot is not None and len(branch.children) == 2
    assert eng.blocks.num_blocks - eng.blocks.num_free == 8 + 1 + 2  # C cached up to 160
    # the next fork at that point resumes there
    d = eng.add("d", P[:130] + prompt("d", 10), max_tokens=2)
    batches = eng.run_until_done()
    assert d.num_cached_prompt == 128 and eng.chunks_of(d, batches)[0] == 12
    assert d.output_ids == expected_output(d.prompt_ids, 2)


def test_identical_prompt_hits_at_the_last_block_before_its_end() -> None:
    """An identical prompt must not get 0 hit because the last token has to run (#22935)."""
    eng = FakeEngine()
    first = eng.add("first", P[:64], max_tokens=1)
    eng.run_until_done()
    # 48: the prefill point; 64: the end of the prefill is on the grid (a decode-track copy),
    # but the lookup stops at 63 tokens so that one token runs
    assert snapshot_depths(eng.cache) == [48, 64]
    again = eng.add("again", P[:64], max_tokens=2)
    batches = eng.run_until_done()
    assert again.num_cached_prompt == 48 and eng.chunks_of(again, batches)[0] == 16
    assert again.output_ids == expected_output(P[:64], 2)
    assert again.output_ids[:1] == first.output_ids


def test_finish_caches_computed_blocks_and_the_decode_snapshot() -> None:
    eng = FakeEngine()
    e = eng.add("e", P[:60], max_tokens=10)
    track_positions: list[int] = []
    while not e.is_finished:
        eng.step()
        if e.track_slot is not None:
            track_positions.append(e.track_pos)
            assert read_state(eng.states, e.track_slot) == fake_state(e.all_ids[:e.track_pos])
    assert track_positions and set(track_positions) == {64}, "no decode track at the grid"
    assert e.track_slot is None and e.state_slot is None and e.block_ids == []
    # 69 tokens computed: 4 full blocks cached, snapshots at the prefill point and the track
    assert snapshot_depths(eng.cache) == [48, 64]
    assert max(n.depth for n in tree_paths(eng.cache)) == 64
    assert eng.blocks.num_blocks - eng.blocks.num_free == 4
    assert eng.states.num_slots - eng.states.num_free == 2
    # the next chat turn resumes from the decode snapshot
    turn = e.all_ids + prompt("turn2", 5)
    f = eng.add("f", turn, max_tokens=2)
    eng.run_until_done()
    assert f.num_cached_prompt == 64 and f.output_ids == expected_output(turn, 2)


def test_snapshot_cap_evicts_least_recently_used() -> None:
    eng = FakeEngine(max_snapshots=2)
    for i in range(4):
        eng.add(f"r{i}", prompt(f"cap{i}", 40), max_tokens=1)
        eng.run_until_done()
        assert eng.cache.num_snapshots == min(i + 1, 2)
    kept = {n.key[:16] for n in tree_paths(eng.cache) if n.state_slot is not None}
    assert kept == {tuple(prompt(f"cap{i}", 40)[:16]) for i in (2, 3)}


def test_decode_track_slot_does_not_evict_cached_snapshots() -> None:
    """The track copy is not in the tree (and has its own slots): taking one must not thin the
    cached snapshots; only caching it at finish counts against max_snapshots."""
    eng = FakeEngine(max_snapshots=2)
    x, y = prompt("x", 100), prompt("y", 100)
    for rid, p in (("x", x), ("y", y)):
        eng.add(rid, p, max_tokens=1)
        eng.run_until_done()
    assert snapshot_keys(eng.cache) == {(x[0], 96), (y[0], 96)}
    r = eng.add("r", prompt("r", 60), max_tokens=10)
    while r.track_slot is None:
        eng.step()
    # r's prefill snapshot at 48 took x's place (the LRU one); y's is still cached
    assert snapshot_keys(eng.cache) == {(y[0], 96), (r.prompt_ids[0], 48)}
    y2 = eng.add("y2", y[:96] + prompt("y2", 8), max_tokens=1)
    eng.step()
    assert y2.num_cached_prompt == 96
    eng.run_until_done()
    assert r.output_ids == expected_output(r.prompt_ids, 10)
    assert eng.cache.num_snapshots == 2


def test_serving_a_prompt_again_does_not_thin_the_cache() -> None:
    """Re-caching a snapshot the tree already has is refused; it must not evict another."""
    eng = FakeEngine(max_snapshots=3)
    keep = prompt("keep", 100)
    eng.add("keep", keep, max_tokens=1)
    eng.run_until_done()
    eng.add("first", P[:64], max_tokens=2)
    eng.run_until_done()
    before = snapshot_keys(eng.cache)
    assert before == {(keep[0], 96), (P[0], 48), (P[0], 64)}
    again = eng.add("again", P[:64], max_tokens=2)
    eng.run_until_done()
    assert again.num_cached_prompt == 48
    assert snapshot_keys(eng.cache) == before
    assert eng.states.num_slots - eng.states.num_free == 3


def test_waiting_queue_longest_cached_prefix_first() -> None:
    eng = FakeEngine(max_num_seqs=1)
    eng.add("warm-long", P[:100], max_tokens=1)
    eng.add("warm-short", prompt("short", 52), max_tokens=1)
    eng.run_until_done()
    assert snapshot_depths(eng.cache) == [48, 96]
    none = eng.add("none", prompt("none", 40), max_tokens=1)
    short = eng.add("short", prompt("short", 52)[:48] + prompt("s", 8), max_tokens=1)
    long = eng.add("long", P[:96] + prompt("l", 8), max_tokens=1)
    batch = eng.step()
    assert batch.reqs == [long] and long.num_cached_prompt == 96
    assert list(eng.scheduler.waiting) == [short, none]
    eng.run_until_done()
    assert (short.num_cached_prompt, none.num_cached_prompt) == (48, 0)


def test_waiting_queue_is_fcfs_beyond_lpm_max_queue() -> None:
    eng = FakeEngine(num_blocks=LPM_MAX_QUEUE * 4, max_num_seqs=1)
    eng.add("warm", P[:100], max_tokens=1)
    eng.run_until_done()
    reqs = [eng.add(f"cold{i}", prompt(f"cold{i}", 20), max_tokens=1)
            for i in range(LPM_MAX_QUEUE)]
    hot = eng.add("hot", P[:96] + prompt("h", 8), max_tokens=1)
    assert len(eng.scheduler.waiting) == LPM_MAX_QUEUE + 1
    batch = eng.step()
    assert batch.reqs == [reqs[0]], "matched every request of a long queue"
    assert list(eng.scheduler.waiting) == reqs[1:] + [hot]


def test_preempted_request_resumes_from_the_cached_prefix() -> None:
    # 8 blocks of 16 and a cached 32-token system prompt: a and b (88 tokens each, sharing its
    # two blocks) need 10 blocks, so b (newest) is preempted, caches what it computed, and
    # resumes from the cache later
    eng = FakeEngine(num_blocks=8, max_num_seqs=2, snapshot_interval=16, max_snapshots=4)
    system = prompt("system", 32)
    eng.add("warm", system + [1], max_tokens=1)
    eng.run_until_done()
    assert snapshot_depths(eng.cache) == [32]
    a = eng.add("a", system + prompt("pa", 8), max_tokens=48)
    b = eng.add("b", system + prompt("pb", 8), max_tokens=48)
    batches = eng.run_until_done(max_steps=400)
    assert b.num_preemptions >= 1 and any(b in x.preempted for x in batches)
    assert a.num_preemptions == 0
    assert a.output_ids == expected_output(a.prompt_ids, 48)
    assert b.output_ids == expected_output(b.prompt_ids, 48)
    assert b.num_cached_prompt >= 32, "the preempted request recomputed from scratch"


@pytest.mark.parametrize("seed", [0, 1])
def test_random_chat_workload_with_prefix_cache(seed: int) -> None:
    """Shared system prompts, follow-up turns, a tight pool (cache eviction, preemption) and few
    snapshot slots; outputs must equal an unconstrained run's, and every cached block and
    snapshot must hold its path's tokens and state after every step."""
    rng = random.Random(seed)
    eng = FakeEngine(num_blocks=24, block_size=4, num_slots=10, max_num_seqs=3, budget=24,
                     snapshot_interval=8, max_snapshots=4)
    systems = [prompt(f"sys{seed}-{i}", rng.randint(10, 30)) for i in range(3)]
    prompts: list[list[int]] = []
    reqs: list[Request] = []
    pending: list[tuple[str, list[int], int]] = []
    for i in range(30):
        if prompts and rng.random() < 0.3:  # a follow-up turn of an earlier conversation
            j = rng.randrange(len(prompts))
            prev = prompts[j] + expected_output(prompts[j], 4)
            p = prev + prompt(f"u{seed}-{i}", rng.randint(1, 6))
        else:
            p = rng.choice(systems) + prompt(f"u{seed}-{i}", rng.randint(1, 12))
        if len(p) + 4 > eng.scheduler.max_request_tokens():
            p = p[:eng.scheduler.max_request_tokens() - 4]
        prompts.append(p)
        pending.append((f"r{i}", p, 4))
    steps = 0
    while pending or eng.scheduler.has_unfinished():
        if pending and steps % 2 == 0:
            reqs.append(eng.add(*pending.pop(0)))
        eng.step()
        steps += 1
        assert steps < 2000
    for r in reqs:
        assert r.status is RequestStatus.FINISHED
        assert r.output_ids == expected_output(r.prompt_ids, 4), r.rid
    assert sum(r.num_cached_prompt for r in reqs) > 0, "workload never hit the cache"
    assert eng.cache.flush()
    eng.check()
    assert eng.blocks.num_free == eng.blocks.num_blocks
    assert eng.states.num_free == eng.states.num_slots


def test_full_pool_evicts_with_headroom() -> None:
    """Once the pool is full of cached prefixes, a block eviction frees 1/128 of the pool
    beyond what was asked, and a snapshot eviction 1/16 of the cap: the blocks a decode grows
    into next come from that headroom, not from another walk over the whole tree (one per
    block before). Outputs and the cache's contents stay right (checked every step)."""
    eng = FakeEngine(num_blocks=512, block_size=4, num_slots=48, max_num_seqs=4, budget=64,
                     snapshot_interval=8, max_snapshots=32)
    walks = 0  # evictions: each walks the whole tree once
    evict_blocks, evict_snapshots = eng.cache.evict_blocks, eng.cache.evict_snapshots

    def blocks(n: int, force: bool = False) -> int:
        nonlocal walks
        walks += 1
        return evict_blocks(n, force)

    def snapshots(n: int) -> int:
        nonlocal walks
        walks += 1
        return evict_snapshots(n)

    eng.cache.evict_blocks = blocks  # type: ignore[method-assign]
    eng.cache.evict_snapshots = snapshots  # type: ignore[method-assign]
    reqs, full_at = [], None
    for i in range(70):  # distinct prompts: the pool is full after ~40
        reqs.append(eng.add(f"r{i}", prompt(f"full{i}", 40), max_tokens=12))
        eng.run_until_done()
        if full_at is None and eng.blocks.num_free < 16:
            full_at, walks = i, 0
    assert full_at is not None and full_at < 50, "the pool never filled: nothing tested"
    per_request = walks / (len(reqs) - 1 - full_at)
    assert per_request < 2.5, f"{per_request:.2f} evictions a request"  # 4.0 without
    for r in reqs:
        assert r.output_ids == expected_output(r.prompt_ids, 12), r.rid
