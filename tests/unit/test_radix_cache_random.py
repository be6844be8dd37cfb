"""Randomized property test of the prefix cache: a few hundred random inserts, matches,
locks and evictions on real pools, each match checked against an independent oracle and the
tree's integrity checked after every operation."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest

from kdaserve.cache.radix_cache import Match, RadixCache

from .radix_fakes import (
    TreeEnv,
    fake_state,
    find,
    is_in_tree,
    read_state,
    tree_paths,
    write_state,
)

# ---- randomized property test ----

@dataclass
class LiveRequest:
    query: list[int]
    match: Match
    blocks: list[int]  # shared from the tree
    slot: int | None  # its working copy of the snapshot


def random_tokens(rng: random.Random, bases: list[list[int]]) -> list[int]:
    """A base prefix (cut anywhere) plus a random tail: lots of shared prefixes, splits and
    mid-block divergences."""
    base = rng.choice(bases)
    tokens = base[:rng.randint(0, len(base))]
    return tokens + [rng.choice((1, 2, 3)) for _ in range(rng.randint(0, 7))]


def oracle(cache: RadixCache, query: list[int]) -> tuple[int, int]:
    """(hit, branch_len) from the tree's contents, computed before `match` touches it."""
    n = len(query) // cache.bs * cache.bs
    hit = branch = 0
    for node, path in tree_paths(cache).items():
        if node.state_slot is not None and node.depth <= n and list(path) == query[:node.depth]:
            hit = max(hit, node.depth)
        common = 0
        while common < min(len(path), n) and path[common] == query[common]:
            common += 1
        branch = max(branch, common // cache.bs * cache.bs)
    return hit, branch


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_keep_the_tree_consistent(seed: int) -> None:
    rng = random.Random(seed)
    env = TreeEnv.make(num_blocks=40, num_slots=12, block_size=2)
    cache = env.cache
    bases = [[rng.choice((1, 2, 3)) for _ in range(rng.randint(6, 16))] for _ in range(4)]
    live: list[LiveRequest] = []
    stats: Counter[str] = Counter()

    def admit(query: list[int]) -> LiveRequest:
        hit, branch = oracle(cache, query)
        m = env.match(query, touch=rng.random() < 0.8)
        assert (m.num_tokens, m.branch_len) == (hit, branch)
        assert env.tokens_of(m.blocks) == query[:hit], "match returned foreign blocks"
        cache.lock(m.node)
        env.share(m.blocks)
        slot = None
        if hit and env.states.num_free:
            assert m.node.state_slot is not None
            slot = env.states.allocate(zero=False)
            env.slots.add(slot)
            env.states.copy(m.node.state_slot, slot)
            assert read_state(env.states, slot) == fake_state(query[:hit])
            write_state(env.states, slot, [0] * 3)  # the request runs on: copy-on-write
        stats["hit" if hit else "miss"] += 1
        stats["kv-beyond-snapshot"] += branch > hit
        env.check()
        return LiveRequest(query, m, m.blocks, slot)

    def leave(req: LiveRequest) -> None:
        cache.unlock(req.match.node)
        env.release(req.blocks)
        if req.slot is not None:
            env.states.free(req.slot)
            env.slots.remove(req.slot)
        env.check()

    for _ in range(300):
        op = rng.choices(["insert", "admit", "leave", "evict_blocks", "evict_snapshots",
                          "flush"], weights=[6, 4, 3, 2, 2, 0.2])[0]
        if op == "insert":
            # a request resumes from the cache, computes the rest and caches a prefix of it
            tokens = random_tokens(rng, bases)
            req = admit(tokens)
            rest = len(tokens) - req.match.num_tokens
            need = env.blocks.blocks_needed(rest)
            if need > env.blocks.num_free:
                cache.evict_blocks(need - env.blocks.num_free)
                env.check()
            if need > env.blocks.num_free:
                leave(req)
                stats["insert-skipped"] += 1
                continue
            req.blocks = req.blocks + env.write(tokens[req.match.num_tokens:])  # block-aligned
            # where it caches a snapshot: anywhere, or again where it resumed (refused)
            cut = rng.choice([rng.randint(0, len(tokens)) // env.bs * env.bs] * 4
                             + [req.match.num_tokens])
            slot = None
            if cut and rng.random() < 0.6:
                if not env.states.num_free:
                    cache.evict_snapshots(1)
                    env.check()
                if env.states.num_free:
                    slot = env.snapshot(tokens[:cut])
            had = find(cache, tokens[:cut])
            expect_kept = slot is not None and (had is None or had.state_slot is None)
            free_slots = env.states.num_free
            kept = cache.insert(tokens[:cut] if slot is not None else tokens, req.blocks, slot)
            env.check()
            assert kept == expect_kept
            if slot is not None and not kept:
                assert env.states.num_free == free_slots + 1, "refused snapshot not freed"
                stats["snapshot-refused"] += 1
            stats["snapshot-kept" if kept else "insert"] += 1
            leave(req)
        elif op == "admit":
            live.append(admit(random_tokens(rng, bases)))
        elif op == "leave" and live:
            leave(live.pop(rng.randrange(len(live))))
        elif op == "evict_blocks":
            n = rng.randint(1, 6)
            evictable, free = cache.evictable_blocks(), env.blocks.num_free
            freed = cache.evict_blocks(n)
            env.check()
            assert freed == env.blocks.num_free - free
            assert freed <= evictable and (freed >= n or freed == evictable)
            stats["evicted-blocks"] += freed
        elif op == "evict_snapshots":
            n = rng.randint(1, 3)
            before, kv = cache.num_snapshots, sorted(cache.tree_blocks())
            assert cache.evict_snapshots(n) == min(n, before)
            env.check()
            assert sorted(cache.tree_blocks()) == kv, "snapshot eviction dropped KV"
            stats["evicted-snapshots"] += min(n, before)
        elif op == "flush":
            assert cache.flush() == all(r.match.node is cache.root for r in live)
            env.check()
            assert cache.num_snapshots == 0
            stats["flush"] += 1
        for r in live:  # in-flight requests keep their path
            assert is_in_tree(cache, r.match.node) and r.match.node.depth == r.match.num_tokens
            assert env.tokens_of(r.blocks) == r.query[:r.match.num_tokens]
    while live:
        leave(live.pop())
    assert cache.flush()
    env.check()
    assert env.blocks.num_free == env.blocks.num_blocks
    assert env.states.num_free == env.states.num_slots
    for what in ("hit", "miss", "kv-beyond-snapshot", "snapshot-kept", "snapshot-refused",
                 "evicted-blocks", "evicted-snapshots", "flush"):
        assert stats[what] > 0, f"the random workload never exercised {what}: {stats}"
