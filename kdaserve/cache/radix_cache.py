"""KDA-aware prefix cache: a radix tree over token ids, block-granular, whose nodes own MLA
latent blocks and optionally a KDA state snapshot.

A KDA state is a point value (the state after exactly N tokens): it cannot be truncated, so a
hit reuses KV only up to the deepest matched node that carries a snapshot. Edges hold whole
blocks (a partly filled block would be written by every request continuing from it). The tree
holds one reference on each block it owns; requests hold their own. Eviction is LRU, separately
over KV (leaves) and over snapshots, skipping nodes locked by in-flight requests.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from kdaserve.cache.block_pool import BlockPool
from kdaserve.cache.state_pool import StatePool

_clock = itertools.count(1)


@dataclass(eq=False)
class Node:
    key: tuple[int, ...] = ()  # tokens on the edge from the parent (whole blocks)
    blocks: list[int] = field(default_factory=list)  # one per block of key
    parent: Node | None = None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)  # by first block
    state_slot: int | None = None  # snapshot after exactly `depth` tokens
    lock: int = 0  # in-flight requests whose matched path runs through this node
    depth: int = 0  # tokens from the root to the end of this node
    last_access: float = 0.0


@dataclass(slots=True)
class Match:
    node: Node  # deepest matched node carrying a snapshot (root if none)
    num_tokens: int  # tokens reusable: node.depth
    blocks: list[int]  # the blocks covering them
    branch_len: int  # tokens matched in KV (may exceed num_tokens), block-aligned


class RadixCache:
    def __init__(self, blocks: BlockPool, states: StatePool) -> None:
        self.pool, self.states = blocks, states
        self.bs = blocks.block_size
        self.root = Node()
        self.num_snapshots = 0
        self.hit_tokens = 0
        self.queried_tokens = 0

    # ---- lookup ----
    def _chunks(self, tokens: list[int]) -> list[tuple[int, ...]]:
        n = len(tokens) // self.bs
        return [tuple(tokens[i * self.bs:(i + 1) * self.bs]) for i in range(n)]

    def match(self, tokens: list[int], touch: bool = True) -> Match:
        """Longest cached prefix of tokens usable to resume (ends at a snapshot). Splits an
        edge matched part-way so later snapshots can attach at the branch point."""
        chunks = self._chunks(tokens)
        node, i = self.root, 0
        best, best_blocks = self.root, []
        path_blocks: list[int] = []
        stamp = next(_clock)
        while i < len(chunks):
            child = node.children.get(chunks[i])
            if child is None:
                break
            child, k, partial = self._descend(child, chunks, i)
            path_blocks.extend(child.blocks)
            i += k
            node = child
            if touch:
                node.last_access = stamp
            if node.state_slot is not None:
                best, best_blocks = node, list(path_blocks)
            if partial:
                break
        if touch:
            # ancestors look older than descendants, so thin shallow snapshots go first
            for d, n in enumerate(self._path(best)):  # deepest first
                n.last_access = stamp - d * 1e-6
        return Match(best, best.depth, best_blocks, i * self.bs)

    def _path(self, node: Node) -> list[Node]:
        out = []
        while node is not self.root:
            out.append(node)
            node = node.parent  # type: ignore[assignment]
        return out

    def _descend(self, child: Node, chunks: list[tuple[int, ...]],
                 i: int) -> tuple[Node, int, bool]:
        """Matches chunks[i:] along child's edge: (node covering the matched blocks, blocks
        matched, whether the edge was left part-way — then it is split there)."""
        n_child = len(child.key) // self.bs
        k = 0
        while k < n_child and i + k < len(chunks) and \
                child.key[k * self.bs:(k + 1) * self.bs] == chunks[i + k]:
            k += 1
        if k < n_child:
            return self._split(child, k), k, True
        return child, k, False

    def _split(self, node: Node, k: int) -> Node:
        """Cuts node's edge after k blocks; returns the new upper node (which has no snapshot:
        a state cannot be split)."""
        cut = k * self.bs
        parent = node.parent
        assert parent is not None
        upper = Node(key=node.key[:cut], blocks=node.blocks[:k], parent=parent,
                     depth=node.depth - len(node.key) + cut, lock=node.lock,
                     last_access=node.last_access)
        parent.children[node.key[:self.bs]] = upper
        node.key, node.blocks = node.key[cut:], node.blocks[k:]
        node.parent = upper
        upper.children[node.key[:self.bs]] = node
        return upper

    # ---- insertion ----
    def insert(self, tokens: list[int], blocks: list[int], state_slot: int | None = None) -> bool:
        """Caches the full blocks of tokens (the request's own blocks; the tree takes a
        reference on those it adopts) and, optionally, a snapshot after exactly len(tokens)
        tokens (len must be block-aligned then). The snapshot slot is owned by the tree
        afterwards, or freed if that position already has one. Returns whether it was kept."""
        chunks = self._chunks(tokens)
        assert len(blocks) >= len(chunks)
        if state_slot is not None:
            assert len(tokens) % self.bs == 0 and chunks, "snapshot must be block-aligned"
        node, i = self.root, 0
        stamp = next(_clock)
        while i < len(chunks):
            child = node.children.get(chunks[i])
            if child is None:
                new = Node(key=tuple(t for c in chunks[i:] for t in c),
                           blocks=blocks[i:len(chunks)],
                           parent=node, depth=node.depth + (len(chunks) - i) * self.bs,
                           last_access=stamp)
                self.pool.share(new.blocks)
                node.children[chunks[i]] = new
                node, i = new, len(chunks)
                break
            child, k, _ = self._descend(child, chunks, i)
            child.last_access = stamp
            node, i = child, i + k
        if state_slot is None:
            return False
        if node.state_slot is not None or node is self.root:
            self.states.free(state_slot)
            return False
        node.state_slot = state_slot
        self.num_snapshots += 1
        return True

    # ---- locking ----
    def lock(self, node: Node) -> None:
        while node is not self.root:
            node.lock += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            assert node.lock > 0
            node.lock -= 1
            node = node.parent  # type: ignore[assignment]

    # ---- eviction ----
    def _nodes(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def evictable_blocks(self) -> int:
        """Blocks eviction would return to the pool (unlocked, no request holds them)."""
        return sum(1 for n in self._nodes() if n.lock == 0
                   for b in n.blocks if self.pool.refcount[b] == 1)

    def evictable_snapshots(self) -> int:
        return sum(1 for n in self._nodes() if n.state_slot is not None)

    def evict_blocks(self, num_blocks: int, force: bool = False) -> int:
        """Frees LRU unlocked leaves until num_blocks blocks returned to the pool. Leaves whose
        blocks running requests still hold free nothing: they go last, and only when forced
        (a flush), so their snapshots are not lost for no memory."""
        refcount = self.pool.refcount

        def entry(n: Node, order: int) -> tuple[bool, float, int, Node]:
            useless = all(refcount[b] > 1 for b in n.blocks)
            return useless, n.last_access, order, n

        # The leaves in a heap, collected once a call (a full tree walk per evicted leaf made
        # a step that grows many block tables quadratic in the cache's size). Removing a leaf
        # changes no other node's key (a block belongs to one node); a parent left without
        # children becomes a candidate.
        heap = [entry(n, i) for i, n in enumerate(self._nodes())
                if not n.children and n.lock == 0]
        heapq.heapify(heap)
        order = len(heap)
        freed = 0
        while freed < num_blocks and heap:
            useless, _, _, victim = heapq.heappop(heap)
            if useless and not force:
                break
            parent = victim.parent
            freed += self._remove_leaf(victim)
            if parent is not None and parent is not self.root and not parent.children \
                    and parent.lock == 0:
                heapq.heappush(heap, entry(parent, order))
                order += 1
        return freed

    def _remove_leaf(self, node: Node) -> int:
        before = self.pool.num_free
        self.pool.free(node.blocks)
        if node.state_slot is not None:
            self._drop_state(node)
        parent = node.parent
        assert parent is not None
        del parent.children[node.key[:self.bs]]
        return self.pool.num_free - before

    def _drop_state(self, node: Node) -> None:
        assert node.state_slot is not None
        self.states.free(node.state_slot)
        node.state_slot = None
        self.num_snapshots -= 1

    def evict_snapshots(self, num: int) -> int:
        """Drops LRU snapshots (KV stays); a snapshot is only read at admission, so none is
        locked."""
        # one tree walk: dropping a state changes no other node's age, so the num oldest
        # (ties in tree order, as a min per victim would take them) are the victims
        holders = [n for n in self._nodes() if n.state_slot is not None]
        victims = heapq.nsmallest(num, holders, key=lambda n: n.last_access)
        for n in victims:
            self._drop_state(n)
        return len(victims)

    def flush(self) -> bool:
        """Drops everything not locked by a running request; False if something was locked."""
        for n in self._nodes():
            if n.state_slot is not None:
                self._drop_state(n)
        self.evict_blocks(self.pool.num_blocks, force=True)
        return not self.root.children

    # ---- integrity ----
    def check_integrity(self, holders: Callable[[int], int] | None = None) -> None:
        """Tree invariants; `holders(block)` (refs held by requests) checks refcounts too."""
        snapshots = 0
        for n in self._nodes():
            assert n.parent is not None and n.parent.children.get(n.key[:self.bs]) is n
            assert len(n.key) == len(n.blocks) * self.bs and n.key, "edge/block mismatch"
            assert n.depth == n.parent.depth + len(n.key)
            assert n.lock >= sum(c.lock for c in n.children.values()), "lock below child's"
            for b in n.blocks:
                assert self.pool.refcount[b] >= 1, f"tree block {b} is free"
                if holders is not None:
                    assert self.pool.refcount[b] == 1 + holders(b), f"block {b} refcount"
            if n.state_slot is not None:
                snapshots += 1
        assert snapshots == self.num_snapshots, "snapshot count drift"

    def tree_blocks(self) -> list[int]:
        return [b for n in self._nodes() for b in n.blocks]

    def snapshot_slots(self) -> list[int]:
        return [n.state_slot for n in self._nodes() if n.state_slot is not None]
