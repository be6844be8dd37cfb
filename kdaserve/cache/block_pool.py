"""Paged MLA latent cache: fixed-size blocks of per-token latents, refcounted.

Each block holds `block_size` tokens of every MLA layer's latent (kv_lora_rank + rope dims).
Refcounts let a prefix cache share blocks between requests.
"""

from __future__ import annotations

import torch

from kdaserve.config import ModelConfig


class BlockPool:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        # one block past the pool, never handed out: a replayed CUDA graph's padding rows
        # write their latents there (engine/cuda_graph.py)
        self.scratch = num_blocks
        self.kv = torch.zeros(len(config.mla_layers), num_blocks + 1, block_size,
                              config.latent_dim, dtype=dtype, device=device)
        self.refcount = [0] * num_blocks
        # bumped each time a block is handed out: what was written into a block for earlier
        # tokens (a context drafter's pages, speculative/context_pages.py) is then stale
        self.generation = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    def release(self) -> None:
        """Frees the latents' memory (RL's release of the KV cache, the pool idle); `resume`
        brings them back zeroed, in the same shape."""
        self._shape = tuple(self.kv.shape)
        self.kv = torch.empty(0, dtype=self.kv.dtype, device=self.kv.device)

    def resume(self) -> None:
        self.kv = torch.zeros(self._shape, dtype=self.kv.dtype, device=self.kv.device)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        size = torch.empty(0, dtype=dtype).element_size()
        return len(config.mla_layers) * block_size * config.latent_dim * size

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"block pool exhausted: need {n}, have {len(self._free)}")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self.refcount[b] = 1
            self.generation[b] += 1
        return out

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            assert self.refcount[b] > 0, f"sharing free block {b}"
            self.refcount[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.refcount[b] <= 0:
                raise RuntimeError(f"block {b} freed twice")
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                self._free.append(b)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate free blocks"
        for b in range(self.num_blocks):
            assert (self.refcount[b] == 0) == (b in free), f"block {b} refcount/free mismatch"
