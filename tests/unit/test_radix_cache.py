"""KDA-aware prefix cache (`RadixCache`) on real pools without a model (fakes in
radix_fakes.py). Integrity (tree, block pool, state pool) is checked after every operation."""

from __future__ import annotations

import random

import pytest

from kdaserve.cache.radix_cache import Node, RadixCache

from .radix_fakes import (
    BS,
    TreeEnv,
    fake_state,
    find,
    is_in_tree,
    read_state,
    seq,
    snapshot_depths,
    snapshot_keys,
    tree_paths,
)

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



def _evict_by_scanning(cache: RadixCache, num_blocks: int) -> tuple[int, list[tuple[int, ...]]]:
    """The eviction rule spelled out: each victim the least recently used unlocked leaf,
    leaves whose blocks running requests hold last (then none), the whole tree rescanned
    after every removal. Returns the blocks freed and the victims' paths in order."""
    paths, freed, order = tree_paths(cache), 0, []
    while freed < num_blocks:
        leaves = [n for n in cache._nodes() if not n.children and n.lock == 0]
        if not leaves:
            break

        def held(n: Node) -> bool:
            return all(cache.pool.refcount[b] > 1 for b in n.blocks)

        victim = min(leaves, key=lambda n: (held(n), n.last_access))
        if held(victim):
            break
        order.append(paths[victim])
        freed += cache._remove_leaf(victim)
    return freed, order


@pytest.mark.parametrize("seed", range(12))
def test_eviction_order_matches_a_full_scan_per_victim(seed: int) -> None:
    """evict_blocks collects the leaves once and keeps them in a heap: the same victims, in
    the same order, as rescanning the tree after each one (parents that become leaves
    included; held and locked paths kept)."""
    rng = random.Random(seed)
    heap_env, scan_env = (TreeEnv.make(num_blocks=256, num_slots=32) for _ in range(2))
    prefixes = [seq(100 * (i + 1), BS * rng.randint(1, 4)) for i in range(3)]
    for _ in range(rng.randint(6, 14)):  # the same operations on both trees
        tokens = rng.choice(prefixes) + seq(rng.randrange(1000, 5000), BS * rng.randint(1, 3))
        op, snapshot = rng.random(), rng.random() < 0.3
        for env in (heap_env, scan_env):
            if op < 0.7:
                env.insert(tokens, snapshot=snapshot)
            else:
                env.match(tokens)
    # running requests: some hold a leaf's blocks (evicting it would free nothing), one has
    # its matched path locked
    leaves = sorted(p for n, p in tree_paths(heap_env.cache).items() if not n.children)
    held = rng.sample(leaves, rng.randint(0, len(leaves) // 2))
    locked = rng.choice(leaves)
    for env in (heap_env, scan_env):
        for path in held:
            node = find(env.cache, path)
            assert node is not None
            env.share(node.blocks)
        node = find(env.cache, locked)
        assert node is not None
        env.cache.lock(node)
    paths = tree_paths(heap_env.cache)
    recorded: list[tuple[int, ...]] = []
    remove = heap_env.cache._remove_leaf

    def record(node: Node) -> int:
        recorded.append(paths[node])
        return remove(node)

    heap_env.cache._remove_leaf = record  # type: ignore[method-assign]
    n = rng.randint(1, 100)
    freed = heap_env.cache.evict_blocks(n)
    assert (freed, recorded) == _evict_by_scanning(scan_env.cache, n)
    assert recorded, "nothing was evicted: the case tests nothing"
    heap_env.check()
