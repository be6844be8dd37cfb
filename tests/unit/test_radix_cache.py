"""KDA-aware prefix cache (`RadixCache`) on real pools without a model, and the scheduler's use of
it driven by a fake runner.

Conventions of the fake "model" used throughout:
- a block written by a request holds the token ids of its positions (tracked in a dict for the
  tree tests, in the paged cache itself for the scheduler tests);
- a state slot holds the state *after exactly N tokens* as (N, rolling hash of those tokens) in
  one recurrent and one conv element, so a snapshot taken at the wrong position, a stale slot, or
  a resumed request that did not get a copy of the right snapshot is caught.
Integrity (tree, block pool, state pool) is checked after every operation.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest
import torch

from kdaserve.cache.block_pool import BlockPool
from kdaserve.cache.radix_cache import Match, Node, RadixCache
from kdaserve.cache.state_pool import StatePool
from kdaserve.checkpoint import preset_config
from kdaserve.engine.scheduler import LPM_MAX_QUEUE, ScheduledBatch, Scheduler
from kdaserve.request import Request, RequestStatus, SamplingParams

CONFIG = preset_config("tiny")
BS = 4  # block size of the tree tests
FAKE_VOCAB = 997  # token ids stay exact in the fp32 cache
HASH_MOD = 1_000_003  # < 2**24: the hash stays exact in an fp32 state element


# ---- the fake model: tokens, states ----

def seq(start: int, n: int) -> list[int]:
    """n readable, distinct token ids."""
    return list(range(start, start + n))


def prefix_hash(tokens: Sequence[int]) -> int:
    h = 0
    for t in tokens:
        h = (h * 131 + t + 1) % HASH_MOD
    return h


def fake_state(tokens: Sequence[int]) -> tuple[int, int]:
    """The fake KDA state after exactly `tokens` (a zeroed slot is the state after none)."""
    return (len(tokens), prefix_hash(tokens))


def read_state(states: StatePool, slot: int) -> tuple[int, int]:
    return (int(states.recurrent[0, slot, 0, 0, 0].item()), int(states.conv[0, slot, 0, 0].item()))


def write_state(states: StatePool, slot: int, tokens: Sequence[int]) -> None:
    n, h = fake_state(tokens)
    states.recurrent[0, slot, 0, 0, 0] = n
    states.conv[0, slot, 0, 0] = h


def fake_next_token(history: Sequence[int]) -> int:
    return prefix_hash(history) % FAKE_VOCAB


def expected_output(prompt: Sequence[int], max_tokens: int) -> list[int]:
    ids = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(fake_next_token(ids))
        ids.append(out[-1])
    return out


# ---- tree inspection (read-only: `match` would split edges) ----

def tree_paths(cache: RadixCache) -> dict[Node, tuple[int, ...]]:
    """Every non-root node with the tokens from the root to its end."""
    out: dict[Node, tuple[int, ...]] = {}
    stack: list[tuple[Node, tuple[int, ...]]] = [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            out[child] = path + child.key
            stack.append((child, out[child]))
    return out


def find(cache: RadixCache, tokens: Sequence[int]) -> Node | None:
    """The node ending exactly after tokens (None if absent or inside an edge)."""
    node, i = cache.root, 0
    while i < len(tokens):
        child = node.children.get(tuple(tokens[i:i + cache.bs]))
        if child is None or tuple(tokens[i:i + len(child.key)]) != child.key:
            return None
        node, i = child, i + len(child.key)
    return node


def is_in_tree(cache: RadixCache, node: Node) -> bool:
    while node is not cache.root:
        parent = node.parent
        if parent is None or parent.children.get(node.key[:cache.bs]) is not node:
            return False
        node = parent
    return True


def snapshot_depths(cache: RadixCache) -> list[int]:
    return sorted(n.depth for n in tree_paths(cache) if n.state_slot is not None)


def snapshot_keys(cache: RadixCache) -> set[tuple[int, int]]:
    """(first token, depth) of every node holding a snapshot."""
    return {(path[0], n.depth) for n, path in tree_paths(cache).items() if n.state_slot is not None}


# ---- the tree on real pools, with simulated requests ----

@dataclass
class TreeEnv:
    """A RadixCache plus what simulated requests hold: block references (`held`), working state
    slots (`slots`), and the tokens each block was written with (`written`)."""

    cache: RadixCache
    held: Counter[int] = field(default_factory=Counter)
    slots: set[int] = field(default_factory=set)
    written: dict[int, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def make(cls, num_blocks: int = 64, num_slots: int = 16, block_size: int = BS) -> TreeEnv:
        blocks = BlockPool(CONFIG, num_blocks, block_size, torch.float32)
        states = StatePool(CONFIG, num_slots, torch.float32)
        env = cls(RadixCache(blocks, states))
        env.check()
        return env

    @property
    def blocks(self) -> BlockPool:
        return self.cache.pool

    @property
    def states(self) -> StatePool:
        return self.cache.states

    @property
    def bs(self) -> int:
        return self.cache.bs

    def check(self) -> None:
        self.blocks.check_integrity()
        self.states.check_integrity()
        self.cache.check_integrity(lambda b: self.held[b])
        for node, path in tree_paths(self.cache).items():
            for j, b in enumerate(node.blocks):
                assert self.written[b] == node.key[j * self.bs:(j + 1) * self.bs], \
                    f"tree block {b} does not hold its edge's tokens"
            if node.state_slot is not None:
                assert read_state(self.states, node.state_slot) == fake_state(path), \
                    f"snapshot at depth {node.depth} is not the state after its path"
        used = self.states.num_slots - self.states.num_free
        assert used == self.cache.num_snapshots + len(self.slots), "state slot leak"

    def write(self, tokens: Sequence[int]) -> list[int]:
        """A request computing tokens into fresh blocks (the last one may be partial)."""
        blocks = self.blocks.allocate(self.blocks.blocks_needed(len(tokens)))
        for j, b in enumerate(blocks):
            self.written[b] = tuple(tokens[j * self.bs:(j + 1) * self.bs])
            self.held[b] += 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        self.blocks.share(blocks)
        self.held.update(blocks)

    def release(self, blocks: list[int]) -> None:
        self.blocks.free(blocks)
        self.held.subtract(blocks)

    def snapshot(self, tokens: Sequence[int]) -> int:
        """A state slot holding the state after exactly tokens, to donate to the tree."""
        slot = self.states.allocate(zero=False)
        write_state(self.states, slot, tokens)
        return slot

    def insert(self, tokens: Sequence[int], snapshot: bool = False) -> tuple[list[int], bool]:
        """A request computes tokens into its own blocks, caches them (and, optionally, a
        snapshot after all of them), then leaves. Returns its blocks and insert's result."""
        blocks = self.write(tokens)
        slot = self.snapshot(tokens) if snapshot else None
        kept = self.cache.insert(list(tokens), blocks, slot)
        self.check()  # the request still holds its blocks here
        self.release(blocks)
        self.check()
        return blocks, kept

    def match(self, tokens: Sequence[int], touch: bool = True) -> Match:
        m = self.cache.match(list(tokens), touch=touch)
        self.check()
        return m

    def tokens_of(self, blocks: list[int]) -> list[int]:
        return [t for b in blocks for t in self.written[b]]


SEQ = seq(100, 24)  # six blocks
OTHER = seq(500, 24)


@pytest.fixture
def env() -> TreeEnv:
    return TreeEnv.make()


# ---- insert then match ----

@pytest.fixture
def seq_env(env: TreeEnv) -> TreeEnv:
    """SEQ cached in KV up to 24 tokens with snapshots after 8 and 16."""
    env.insert(SEQ[:8], snapshot=True)
    env.insert(SEQ[:16], snapshot=True)
    env.insert(SEQ)
    assert snapshot_depths(env.cache) == [8, 16]
    return env


@pytest.mark.parametrize(("query", "hit", "branch_len"), [
    (SEQ, 16, 24),
    (SEQ + seq(900, 5), 16, 24),
    (SEQ[:16], 16, 16),
    (SEQ[:19], 16, 16),
    (SEQ[:12], 8, 12),
    (SEQ[:15], 8, 12),
    (SEQ[:8], 8, 8),
    (SEQ[:4], 0, 4),
    (SEQ[:3], 0, 0),
    (SEQ[:18] + [7, 7], 16, 16),
    (SEQ[:9] + [7, 7, 7], 8, 8),
    (OTHER, 0, 0),
    ([], 0, 0),
], ids=["identical", "longer-than-cached", "exactly-at-snapshot-16", "partial-block-after-16",
        "between-snapshots", "partial-block-between-snapshots", "exactly-at-snapshot-8",
        "before-first-snapshot", "shorter-than-a-block", "diverges-mid-block-after-16",
        "diverges-mid-block-after-8", "unrelated", "empty"])
def test_match_reuses_kv_only_up_to_the_deepest_snapshot(seq_env: TreeEnv, query: list[int],
                                                         hit: int, branch_len: int) -> None:
    env = seq_env
    m = env.match(query)
    assert m.num_tokens == hit and m.node.depth == hit
    assert m.branch_len == branch_len, "branch_len is not the block-aligned KV-matched length"
    assert env.tokens_of(m.blocks) == query[:hit], "matched blocks do not hold the query prefix"
    if hit:
        assert m.node.state_slot is not None
        assert read_state(env.states, m.node.state_slot) == fake_state(query[:hit])
    else:
        assert m.node is env.cache.root and m.blocks == []


def test_match_on_an_empty_tree_misses() -> None:
    env = TreeEnv.make()
    m = env.match(SEQ)
    assert (m.node, m.num_tokens, m.blocks, m.branch_len) == (env.cache.root, 0, [], 0)


def test_kv_without_a_snapshot_gives_no_hit_but_a_branch_len(env: TreeEnv) -> None:
    env.insert(SEQ)
    m = env.match(SEQ)
    assert (m.num_tokens, m.blocks, m.branch_len) == (0, [], 24)


def test_identical_sequence_inserted_twice_keeps_the_first_blocks_and_snapshot(
        env: TreeEnv) -> None:
    first, kept_first = env.insert(SEQ[:16], snapshot=True)
    node = find(env.cache, SEQ[:16])
    assert kept_first and node is not None and node.state_slot is not None
    slot = node.state_slot
    free_slots = env.states.num_free
    # the same tokens computed again in other blocks, with a second snapshot of the same position
    second = env.write(SEQ[:16])
    dup = env.snapshot(SEQ[:16])
    assert not env.cache.insert(SEQ[:16], second, dup), "a second snapshot was kept"
    env.check()
    assert env.states.num_free == free_slots, "the duplicate snapshot slot was not freed"
    assert dup not in env.cache.snapshot_slots() and node.state_slot == slot
    assert [env.blocks.refcount[b] for b in second] == [1] * 4, "tree took refs on duplicates"
    assert env.cache.tree_blocks() == first
    env.release(second)
    env.check()
    assert env.blocks.num_free == env.blocks.num_blocks - 4


def test_one_sequence_a_prefix_of_another(env: TreeEnv) -> None:
    env.insert(SEQ[:8], snapshot=True)
    _, kept = env.insert(SEQ, snapshot=True)  # extends the cached sequence
    assert kept
    assert len(tree_paths(env.cache)) == 2 and snapshot_depths(env.cache) == [8, 24]
    _, kept = env.insert(SEQ[:16], snapshot=True)  # a prefix of a cached edge: split there
    assert kept
    assert snapshot_depths(env.cache) == [8, 16, 24]
    assert len(env.cache.tree_blocks()) == 6, "dedup failed: blocks cached twice"
    for n in (4, 8, 16, 24):
        m = env.match(SEQ[:n] + [1, 2, 3, 4])
        assert m.num_tokens == (n if n >= 8 else 0)
        assert env.tokens_of(m.blocks) == SEQ[:m.num_tokens]


def test_snapshot_at_the_root_is_refused(env: TreeEnv) -> None:
    slot = env.states.allocate(zero=False)
    with pytest.raises(AssertionError):
        env.cache.insert([], [], slot)
    assert env.cache.num_snapshots == 0 and not env.cache.root.children
    assert env.cache.root.state_slot is None
    env.states.free(slot)  # still the caller's
    env.check()


def test_snapshot_must_be_block_aligned(env: TreeEnv) -> None:
    blocks = env.write(SEQ[:10])
    slot = env.snapshot(SEQ[:10])
    with pytest.raises(AssertionError, match="block-aligned"):
        env.cache.insert(SEQ[:10], blocks, slot)
    assert not env.cache.root.children
    env.states.free(slot)
    env.release(blocks)
    env.check()


# ---- splitting ----

def test_match_part_way_along_an_edge_splits_it(env: TreeEnv) -> None:
    env.insert(SEQ[:16], snapshot=True)
    env.insert(SEQ[:16] + seq(700, 8), snapshot=True)
    env.insert(SEQ[:16] + seq(800, 4))
    lower = find(env.cache, SEQ[:16])
    assert lower is not None and lower.state_slot is not None
    slot, children = lower.state_slot, dict(lower.children)
    held = env.match(SEQ[:16] + seq(700, 8))  # a request in flight locks the whole path
    env.cache.lock(held.node)
    assert lower.lock == 1

    m = env.match(SEQ[:8] + seq(900, 4))  # leaves the edge after two of its four blocks
    assert m.num_tokens == 0 and m.branch_len == 8
    upper = lower.parent
    assert upper is not None and upper is not env.cache.root
    assert env.cache.root.children[tuple(SEQ[:4])] is upper
    assert upper.key == tuple(SEQ[:8]) and upper.depth == 8
    assert upper.state_slot is None, "the upper half of a split must not get a snapshot"
    assert upper.lock == 1, "the split lost the lock of the path through it"
    assert upper.children == {tuple(SEQ[8:12]): lower}
    assert lower.key == tuple(SEQ[8:16]) and lower.depth == 16 and lower.lock == 1
    assert lower.state_slot == slot and lower.children == children
    assert all(c.parent is lower for c in children.values())
    assert env.tokens_of(upper.blocks + lower.blocks) == SEQ[:16]

    env.cache.unlock(held.node)
    env.check()
    assert all(n.lock == 0 for n in tree_paths(env.cache))


def test_insert_diverging_part_way_along_an_edge_splits_it(env: TreeEnv) -> None:
    env.insert(SEQ, snapshot=True)
    _, kept = env.insert(SEQ[:12] + seq(700, 8), snapshot=True)
    assert kept
    branch = find(env.cache, SEQ[:12])
    assert branch is not None and branch.state_slot is None and branch.depth == 12
    assert sorted(c.key[0] for c in branch.children.values()) == [SEQ[12], 700]
    assert snapshot_depths(env.cache) == [20, 24]
    assert len(env.cache.tree_blocks()) == 8  # 3 shared + 3 + 2
    for query in (SEQ, SEQ[:12] + seq(700, 8)):
        m = env.match(query)
        assert env.tokens_of(m.blocks) == query


def test_snapshot_fills_a_split_point_that_had_none(env: TreeEnv) -> None:
    env.insert(SEQ, snapshot=True)
    env.match(SEQ[:8] + [1, 1, 1, 1])  # splits at 8 without a snapshot
    node = find(env.cache, SEQ[:8])
    assert node is not None and node.state_slot is None
    blocks = env.write(SEQ[:8])
    assert env.cache.insert(SEQ[:8], blocks, env.snapshot(SEQ[:8]))
    assert node.state_slot is not None and find(env.cache, SEQ[:8]) is node
    assert all(env.blocks.refcount[b] == 1 for b in blocks), "dedup: tree adopted copies"
    env.release(blocks)
    env.check()
    assert env.match(SEQ[:11]).num_tokens == 8


# ---- locking and KV eviction ----

def test_locked_path_is_never_evicted(env: TreeEnv) -> None:
    env.insert(SEQ[:16], snapshot=True)
    env.insert(OTHER[:12], snapshot=True)
    m = env.match(SEQ[:16])
    env.cache.lock(m.node)
    env.check()
    assert env.cache.evictable_blocks() == 3
    free = env.blocks.num_free
    assert env.cache.evict_blocks(100) == 3
    env.check()
    assert env.blocks.num_free == free + 3
    assert is_in_tree(env.cache, m.node) and env.cache.tree_blocks() == m.node.blocks
    assert env.cache.evictable_blocks() == 0 and env.cache.evict_blocks(1) == 0
    env.cache.unlock(m.node)
    env.check()
    assert env.cache.evictable_blocks() == 4
    assert env.cache.evict_blocks(1) == 4  # a whole leaf goes
    env.check()
    assert not env.cache.root.children and env.blocks.num_free == env.blocks.num_blocks


def test_lock_covers_ancestors_only(env: TreeEnv) -> None:
    env.insert(SEQ[:8], snapshot=True)
    env.insert(SEQ[:16], snapshot=True)
    env.insert(SEQ[:8] + seq(700, 4))
    m = env.match(SEQ[:16])
    env.cache.lock(m.node)
    env.cache.lock(m.node)
    mid = find(env.cache, SEQ[:8])
    sibling = find(env.cache, SEQ[:8] + seq(700, 4))
    assert mid is not None and sibling is not None
    assert (m.node.lock, mid.lock, sibling.lock) == (2, 2, 0)
    assert env.cache.evictable_blocks() == 1
    env.cache.unlock(m.node)
    env.check()
    assert (m.node.lock, mid.lock) == (1, 1)
    env.cache.unlock(m.node)
    env.check()
    assert env.cache.evictable_blocks() == 5


def test_blocks_held_by_a_request_are_not_evictable(env: TreeEnv) -> None:
    """A request that cached its blocks (a prefill snapshot) keeps using them: evicting that
    node would free no memory, so it is kept (with its snapshot) unless forced; forcing drops
    only the tree's reference."""
    blocks = env.write(SEQ[:12])
    assert env.cache.insert(SEQ[:12], blocks, env.snapshot(SEQ[:12]))
    env.check()
    assert env.cache.evictable_blocks() == 0
    free_blocks, free_slots = env.blocks.num_free, env.states.num_free
    assert env.cache.evict_blocks(1) == 0
    env.check()
    assert env.cache.root.children, "a leaf that frees nothing was evicted"
    assert env.cache.evict_blocks(1, force=True) == 0
    env.check()
    assert not env.cache.root.children, "the forced eviction kept the leaf"
    assert env.blocks.num_free == free_blocks, "blocks still in use returned to the pool"
    assert all(env.blocks.refcount[b] == 1 for b in blocks)
    assert env.states.num_free == free_slots + 1, "the evicted leaf's snapshot leaked"
    env.release(blocks)
    env.check()
    assert env.blocks.num_free == env.blocks.num_blocks


# ---- LRU ----

def test_kv_eviction_takes_least_recently_matched_leaves_first(env: TreeEnv) -> None:
    a, b, c = seq(100, 8), seq(200, 8), seq(300, 8)
    env.insert(a, snapshot=True)
    env.insert(a + seq(400, 4))  # a leaf below a
    env.insert(b, snapshot=True)
    env.insert(c, snapshot=True)
    env.match(a)  # a is now the most recent, but not a leaf while its child is cached
    env.match(b, touch=False)  # an ordering probe: no effect on the LRU order
    order: list[int] = []
    while env.cache.root.children:
        before = {n.key[0] for n in tree_paths(env.cache)}
        assert env.cache.evict_blocks(1) >= 1
        env.check()
        order += sorted(before - {n.key[0] for n in tree_paths(env.cache)})
    assert order == [400, 200, 300, 100]
    assert env.states.num_free == env.states.num_slots


def test_kv_matched_beyond_the_snapshot_counts_as_used(env: TreeEnv) -> None:
    """A match that reaches into KV-only nodes (branch_len > hit) refreshes them too: the
    request will leave a snapshot at the branch point there."""
    env.insert(SEQ[:12])
    env.insert(OTHER[:12])
    m = env.match(SEQ[:12])
    assert (m.num_tokens, m.branch_len) == (0, 12)
    assert env.cache.evict_blocks(1) == 3
    env.check()
    assert list(tree_paths(env.cache).values()) == [tuple(SEQ[:12])]


def test_snapshot_eviction_thins_the_ancestors_of_a_match_first(env: TreeEnv) -> None:
    for n in (4, 8, 12):
        env.insert(SEQ[:n], snapshot=True)
    env.insert(OTHER[:8], snapshot=True)  # newer than the chain...
    env.match(SEQ[:12])  # ...until the chain is matched: ancestors look older than the node
    blocks = sorted(env.cache.tree_blocks())
    dropped: list[tuple[int, int]] = []
    while env.cache.num_snapshots:
        before, free = snapshot_keys(env.cache), env.states.num_free
        assert env.cache.evict_snapshots(1) == 1
        env.check()
        assert env.states.num_free == free + 1, "evicted snapshot's slot not freed"
        (gone,) = before - snapshot_keys(env.cache)
        dropped.append(gone)
        assert sorted(env.cache.tree_blocks()) == blocks, "snapshot eviction dropped KV"
    assert dropped == [(OTHER[0], 8), (SEQ[0], 4), (SEQ[0], 8), (SEQ[0], 12)]
    assert env.cache.evict_snapshots(1) == 0
    m = env.match(SEQ)
    assert (m.num_tokens, m.branch_len) == (0, 12)


def test_evict_snapshots_counts(env: TreeEnv) -> None:
    for tokens in (SEQ[:8], SEQ[:16], OTHER[:4]):
        env.insert(tokens, snapshot=True)
    assert env.cache.evictable_snapshots() == 3
    assert env.cache.evict_snapshots(2) == 2
    env.check()
    assert env.cache.evict_snapshots(5) == 1
    env.check()
    assert env.cache.num_snapshots == 0 and env.states.num_free == env.states.num_slots
    assert len(env.cache.tree_blocks()) == 5


# ---- flush ----

def test_flush_drops_everything(env: TreeEnv) -> None:
    env.insert(SEQ[:8], snapshot=True)
    env.insert(SEQ, snapshot=True)
    env.insert(OTHER[:12])
    env.match(SEQ[:13])  # a split on top
    assert env.cache.flush()
    env.check()
    assert not env.cache.root.children and env.cache.num_snapshots == 0
    assert env.blocks.num_free == env.blocks.num_blocks
    assert env.states.num_free == env.states.num_slots


def test_flush_keeps_a_locked_path(env: TreeEnv) -> None:
    env.insert(SEQ[:8], snapshot=True)
    env.insert(SEQ, snapshot=True)
    env.insert(OTHER[:12], snapshot=True)
    m = env.match(SEQ[:8] + [1, 2, 3, 4])  # a running request resumed at 8
    env.cache.lock(m.node)
    env.share(m.blocks)
    assert not env.cache.flush()
    env.check()
    paths = list(tree_paths(env.cache).values())
    assert paths == [tuple(SEQ[:8])], "flush kept more than the locked path"
    assert env.cache.num_snapshots == 0 and env.states.num_free == env.states.num_slots
    assert env.blocks.num_free == env.blocks.num_blocks - 2
    env.cache.unlock(m.node)
    env.release(m.blocks)
    env.check()
    assert env.cache.flush()
    env.check()
    assert env.blocks.num_free == env.blocks.num_blocks


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
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens:
                sampled.append(req)
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


def test_prompt_prefill_is_cut_at_the_last_block_boundary_and_cached() -> None:
    eng = FakeEngine()
    a = eng.add("a", P[:100], max_tokens=1)
    batches = eng.run_until_done()
    assert eng.chunks_of(a, batches) == [96, 4], "prefill not cut at the snapshot point (96)"
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
        assert b.snapshot_points == [112]  # 125 // 16 * 16; the grid point 64 is already cached
        assert batch.num_new_tokens == [16], "first chunk not cut at the snapshot point"
        # the request's kernels update its slot in place
        eng.states.recurrent[:, b.state_slot] = 9.0
        eng.states.conv[:, b.state_slot] = 9.0
        write_state(eng.states, b.state_slot, b_prompt[:96])

    eng.step(admitted)
    assert eng.cache.hit_tokens == 96 and eng.cache.queried_tokens == 100 + 126
    assert torch.equal(eng.states.recurrent[:, snap], saved[0]), "snapshot written through"
    assert torch.equal(eng.states.conv[:, snap], saved[1])
    batches = eng.run_until_done()
    assert eng.chunks_of(b, batches)[0] == 14 and b.output_ids == expected_output(b_prompt, 3)
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
    assert eng.chunks_of(c, batches) == [128, 16, 16], "not cut at the branch point and 144"
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
