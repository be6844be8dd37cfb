"""Tensor parallelism as the layers see it: how many heads or intermediate rows this rank
holds, which checkpoint tensors it holds a slice of, and the all-reduce that sums the
row-parallel projections' partial outputs.

Column-parallel weights (q/k/v/gate projections, MLA's per-head up-projections, the experts'
w1/w3) keep this rank's rows; row-parallel ones (every o_proj, the experts' w2) keep its
columns, and their outputs are partial sums over ranks. Low-rank and latent projections
(KDA's f_a/g_a, MLA's kv_a and q_a), norms, the router, embeddings and the LM head are
replicated. KDA states therefore hold only this rank's heads; MLA's single latent "head" is
replicated on every rank (DP attention is what stores it once).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

# this process's collective traffic (rank 0 reports it in the engine's metrics)
COMM = {"all_reduces": 0, "all_reduce_bytes": 0, "all_reduce_s": 0.0, "broadcast_s": 0.0}


@dataclass(frozen=True, slots=True)
class Shard:
    """A destination holding part `rank` of `size` equal slices of a checkpoint tensor along
    `dim` (the loader reads the checkpoint's full shape and keeps that slice)."""

    dest: torch.Tensor
    dim: int
    rank: int
    size: int

    @property
    def full_shape(self) -> tuple[int, ...]:
        shape = list(self.dest.shape)
        shape[self.dim] *= self.size
        return tuple(shape)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        n = self.dest.shape[self.dim]
        return full.narrow(self.dim, self.rank * n, n)


Destination = torch.Tensor | Shard


def full_shape(dest: Destination) -> tuple[int, ...]:
    return dest.full_shape if isinstance(dest, Shard) else tuple(dest.shape)


def tensor_of(dest: Destination) -> torch.Tensor:
    return dest.dest if isinstance(dest, Shard) else dest


@dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed process group of the TP ranks

    def part(self, n: int, what: str) -> int:
        """This rank's share of n heads or rows."""
        if n % self.size:
            raise ValueError(f"{what} = {n} is not divisible by tp_size = {self.size}")
        return n // self.size

    def shard(self, dest: torch.Tensor, dim: int) -> Destination:
        return dest if self.size == 1 else Shard(dest, dim, self.rank, self.size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums the ranks' partial outputs in place (a no-op on one rank)."""
        if self.size > 1:
            start = time.perf_counter()
            torch.distributed.all_reduce(x, group=self.group)
            COMM["all_reduce_s"] += time.perf_counter() - start
            COMM["all_reduces"] += 1
            COMM["all_reduce_bytes"] += x.numel() * x.element_size()
        return x


SINGLE = TensorParallel()
