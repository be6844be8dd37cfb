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
from dataclasses import dataclass, replace
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


@dataclass(frozen=True, slots=True)
class Prefix(Shard):
    """The first `size * len(dest)` entries of a longer 1-D checkpoint tensor, part `rank`
    of them here: K3 stores `A_log` as [128] for its 96 heads, every engine uses the first
    96, and a tensor-parallel rank its heads' share of those. The loader takes any stored
    length from the head count up (`full_len`: the length the writer gives it)."""

    full_len: int = 0

    @property
    def full_shape(self) -> tuple[int, ...]:
        return (self.full_len,)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        n = self.dest.shape[0]
        return full[self.rank * n:(self.rank + 1) * n]

    def stored_as(self, shape: list[int] | tuple[int, ...]) -> Prefix:
        """This destination for a stored tensor of `shape`, if it is 1-D and long enough
        (else unchanged: the shape check names what was expected)."""
        if len(shape) == 1 and shape[0] >= self.dest.shape[0] * self.size:
            return replace(self, full_len=shape[0])
        return self


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


@dataclass(frozen=True, slots=True)
class ExpertParallel:
    """DP attention with expert parallelism: each rank runs attention (KDA, MLA) and the
    dense layers on its own requests' tokens, with its own caches; every MoE layer gathers
    all ranks' tokens, each rank applies the experts it holds (`experts`) to the token-expert
    pairs routed to them, and the summed output goes back to the rows' owners. Every rank
    runs every MoE layer's collectives each step, an idle rank with no tokens."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def experts(self, num_experts: int) -> range:
        n = num_experts // self.size
        if n * self.size != num_experts:
            raise ValueError(f"num_experts = {num_experts} is not divisible by ep_size = "
                             f"{self.size}")
        return range(self.rank * n, (self.rank + 1) * n)

    def any_busy(self, busy: bool) -> bool:
        """Whether any rank has tokens this step (every rank asks, every step)."""
        flag = torch.tensor([int(busy)])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def gather(self, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Every rank's rows [sum T, D] (rank order) and each rank's row count."""
        dist = torch.distributed
        start = time.perf_counter()
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(counts, torch.tensor([x.shape[0]]), group=self.group)
        sizes = [int(c) for c in counts]
        pad = max(sizes)
        padded = torch.zeros(pad, x.shape[1], dtype=x.dtype)
        padded[:x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded, group=self.group)
        COMM["all_gather_s"] = COMM.get("all_gather_s", 0.0) + time.perf_counter() - start
        COMM["all_gather_bytes"] = COMM.get("all_gather_bytes", 0) + \
            pad * self.size * x.shape[1] * x.element_size()
        return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)]), sizes

    def combine(self, y: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Sums the ranks' partial outputs for all rows and keeps this rank's."""
        start = time.perf_counter()
        if y.shape[0]:
            torch.distributed.all_reduce(y, group=self.group)
        COMM["all_reduce_s"] += time.perf_counter() - start
        COMM["all_reduces"] += 1
        COMM["all_reduce_bytes"] += y.numel() * y.element_size()
        first = sum(sizes[:self.rank])
        return y[first:first + sizes[self.rank]]


SINGLE_EP = ExpertParallel()
