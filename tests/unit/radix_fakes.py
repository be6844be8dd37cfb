"""Shared fakes for the scheduler and prefix-cache tests (no model).

- a block written by a request holds the token ids of its positions;
- a state slot holds the state *after exactly N tokens* as (N, rolling hash of those tokens) in
  one recurrent and one conv element, so a snapshot taken at the wrong position, a stale slot, or
  a resumed request that did not get a copy of the right snapshot is caught.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kdaserve.cache.block_pool import BlockPool
from kdaserve.cache.radix_cache import Match, Node, RadixCache
from kdaserve.cache.state_pool import StatePool
from kdaserve.checkpoint import preset_config

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
