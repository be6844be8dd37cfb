"""A context drafter's cache entries, paged like the target's KV: position p of a request
lives in row p % block_size of its block block_ids[p // block_size].

Sharing the target's block ids is what carries the drafter's context across prefix-cache hits
(as SGLang's draft KV pool shares the target's token slots): a request resuming from cached
blocks finds the entries its predecessor wrote there, a second turn drafts from the whole
conversation, and a preempted request finds its own. A row is valid only if it was written
since its block was last allocated (`BlockPool.generation`): a block handed out again, to
other tokens, reads as empty until rewritten, and a position whose taps never came (taps
stopped while no request drafted, a prompt that came from a prefill server) stays masked.
"""

from __future__ import annotations

import math

import torch

from kdaserve.cache.block_pool import BlockPool


class ContextPages:
    def __init__(self, pool: BlockPool, widths: tuple[int, ...], num_layers: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.pool, self.bs, self.device = pool, pool.block_size, device
        self.shape = (pool.num_blocks, self.bs, *widths)
        self.dtype, self.num_layers = dtype, num_layers
        self._allocate()

    def _allocate(self) -> None:
        self.layers = [torch.zeros(self.shape, dtype=self.dtype, device=self.device)
                       for _ in range(self.num_layers)]
        # the block's generation when the row was written (generations start at 1)
        self.stamp = torch.zeros(self.shape[:2], dtype=torch.int64, device=self.device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.layers, self.stamp))

    @staticmethod
    def bytes_per_block(widths: tuple[int, ...], num_layers: int, dtype: torch.dtype,
                        block_size: int) -> int:
        """What one KV block's pages take (each layer's entries and the rows' stamps): the
        memory plan's share of a block (engine/pools.py)."""
        return block_size * (num_layers * math.prod(widths) * dtype.itemsize + 8)

    def release(self) -> None:
        """Frees the pages (RL's release_memory_occupation of the KV cache, which the prefix
        cache was flushed for); `resume` brings them back empty, every row unwritten."""
        self.layers = [t.new_empty(0) for t in self.layers]
        self.stamp = self.stamp.new_empty(0)

    def resume(self) -> None:
        if self.stamp.numel() == 0:  # released (a pool has blocks)
            self._allocate()

    def _generations(self, blocks: list[int]) -> torch.Tensor:
        return torch.tensor([self.pool.generation[b] for b in blocks], dtype=torch.long,
                            device=self.device)

    def write(self, block_ids: list[int], pos: torch.Tensor,
              entries: list[torch.Tensor]) -> None:
        """entries[layer][i] is position pos[i]'s (the request holds those positions'
        blocks)."""
        first, last = int(pos.min()) // self.bs, int(pos.max()) // self.bs
        table = torch.tensor(block_ids[first:last + 1], dtype=torch.long, device=self.device)
        at = pos // self.bs - first
        b, r = table[at], pos % self.bs
        for layer, e in zip(self.layers, entries, strict=True):
            layer[b, r] = e.to(layer.dtype)
        self.stamp[b, r] = self._generations(block_ids[first:last + 1])[at]

    def read(self, block_ids: list[int], n: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Positions 0 .. n - 1 of a request: per layer [n, *widths], and which are valid."""
        if n == 0:
            return ([layer.new_empty(0, *layer.shape[2:]) for layer in self.layers],
                    torch.zeros(0, dtype=torch.bool, device=self.device))
        blocks = block_ids[:-(-n // self.bs)]
        table = torch.tensor(blocks, dtype=torch.long, device=self.device)
        entries = [layer[table].flatten(0, 1)[:n] for layer in self.layers]
        valid = (self.stamp[table] == self._generations(blocks)[:, None]).flatten()[:n]
        return entries, valid
