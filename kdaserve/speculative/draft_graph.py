"""A context drafter's drafting pass (K3's published drafters) replayed from CUDA graphs, one
per (batch-size bucket, context-length bucket, drafts), as the target's decode steps are
(engine/cuda_graph.py).

The pass is the block of the anchor and its mask tokens through the drafter's layers, the
target's lm_head on its rows and, for DSpark, the sequential Markov correction: k argmaxes in
a row. On a GPU at batch 1 that is a few hundred small kernels whose launches take longer than
they run. A graph replays them from one launch. What it reads is static: each pass copies its
requests' anchors and first positions, and their context entries as the pages hold them, into
buffers of the bucket's size. Positions past a request's context are masked, and the rows of
padding requests read only their own block (their drafts are dropped). Contexts longer than
MAX_CONTEXT run eagerly: a bucket's buffers hold batch x length entries per layer.

Without CUDA (the tests) the same static-buffer pass runs eagerly: buckets, padding and masks
are checked on the CPU, the capture itself only on a GPU.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from kdaserve.kernels.graphs import capture
from kdaserve.speculative.context_net import ContextDraftNet

logger = logging.getLogger("kdaserve")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
CONTEXT_BUCKETS = tuple(2 ** i for i in range(8, 14))  # 256 .. 8,192 positions
MAX_CONTEXT = CONTEXT_BUCKETS[-1]

Entries = tuple[list[torch.Tensor], torch.Tensor]  # per layer [S, ...], valid [S]


class DraftKey(NamedTuple):
    bs: int  # requests: a batch-size bucket
    length: int  # context positions: a length bucket
    k: int  # drafts per request


class Buffers(NamedTuple):
    anchors: torch.Tensor  # [bs] each request's last token
    starts: torch.Tensor  # [bs] the position of its anchor
    ctx: list[torch.Tensor]  # per layer [bs, length, ...]
    mask: torch.Tensor  # [bs, length] True: a context entry to read
    drafts: torch.Tensor  # [bs, k] out
    conf: torch.Tensor | None  # [bs, k] out, with a confidence head


class DraftGraphs:
    """`run` drafts for up to BATCH_BUCKETS[-1] requests whose contexts fit MAX_CONTEXT.
    `capture`: record CUDA graphs (False: run the static-buffer pass eagerly, the CPU tests'
    mode)."""

    def __init__(self, net: ContextDraftNet, embed: Callable[[torch.Tensor], torch.Tensor],
                 lm_head: Callable[[torch.Tensor], torch.Tensor], block_size: int,
                 device: torch.device, capture: bool = True) -> None:
        self.net, self.embed, self.lm_head = net, embed, lm_head
        self.block_size, self.device = block_size, device
        self.capture = capture
        self.dtype = next(net.parameters()).dtype
        self.buffers: dict[DraftKey, Buffers] = {}
        self.graphs: dict[DraftKey, torch.cuda.CUDAGraph] = {}
        self.pool: Any = None  # the graphs' shared memory pool
        self.failed = False  # a capture failed: drafting runs eagerly from then on

    def key(self, num_reqs: int, length: int, k: int) -> DraftKey | None:
        """The graph for this pass, or None where it runs eagerly."""
        if self.failed or num_reqs > BATCH_BUCKETS[-1] or length > MAX_CONTEXT:
            return None
        bs = BATCH_BUCKETS[bisect.bisect_left(BATCH_BUCKETS, num_reqs)]
        return DraftKey(bs, CONTEXT_BUCKETS[bisect.bisect_left(CONTEXT_BUCKETS, length)], k)

    def run(self, key: DraftKey, anchors: list[int], starts: list[int],
            read: list[Entries]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Drafts [B, k] and confidences [B, k] (or None) of B requests (their anchors, the
        anchors' positions, their context entries as `ContextPages.read` gives them): views
        of the static outputs, overwritten by the next pass. None where the key's capture
        failed: the caller drafts eagerly."""
        b = self._buffers(key)
        if self.capture and key not in self.graphs:
            try:
                self.graphs[key] = capture(lambda: self._pass(key, b), self.device, self.pool)
                self.pool = self.graphs[key].pool()
            except Exception:  # noqa: BLE001 - drafted eagerly, said once, loudly
                logger.exception("CUDA graph capture of the drafting pass failed at %s: "
                                 "drafting runs eagerly from now on", key)
                self.failed = True
                self.reset()
                return None
        self._load(b, anchors, starts, read)
        if self.capture:
            self.graphs[key].replay()
        else:
            self._pass(key, b)
        n = len(anchors)
        return b.drafts[:n], None if b.conf is None else b.conf[:n]

    def reset(self) -> None:
        """Drops every graph and buffer (they hold addresses an RL memory release frees)."""
        self.graphs.clear()
        self.buffers.clear()
        self.pool = None

    def _buffers(self, key: DraftKey) -> Buffers:
        b = self.buffers.get(key)
        if b is None:
            dev, bs = self.device, key.bs
            self.buffers[key] = b = Buffers(
                torch.zeros(bs, dtype=torch.long, device=dev),
                torch.zeros(bs, dtype=torch.long, device=dev),
                [torch.zeros(bs, key.length, *self.net.c.cache_width, dtype=self.dtype,
                             device=dev)
                 for _ in range(self.net.c.num_layers)],
                torch.zeros(bs, key.length, dtype=torch.bool, device=dev),
                torch.zeros(bs, key.k, dtype=torch.long, device=dev),
                torch.zeros(bs, key.k, device=dev) if self.net.c.confidence else None)
        return b

    def _load(self, b: Buffers, anchors: list[int], starts: list[int],
              read: list[Entries]) -> None:
        """The pass's requests into the buffers' first rows; every other row and position
        masked (stale entries stay: finite, and never read)."""
        n = len(anchors)
        b.anchors[:n].copy_(torch.tensor(anchors), non_blocking=True)
        b.starts[:n].copy_(torch.tensor(starts), non_blocking=True)
        b.mask.zero_()
        for i, (entries, valid) in enumerate(read):
            for dst, src in zip(b.ctx, entries, strict=True):
                dst[i, :src.shape[0]].copy_(src)
            b.mask[i, :valid.shape[0]].copy_(valid)

    def _pass(self, key: DraftKey, b: Buffers) -> None:
        """The drafting pass on the buffers (what a graph records)."""
        drafts, conf = self.net.drafting_pass(b.anchors, b.starts, b.ctx, b.mask,
                                              self.block_size, key.k, self.embed, self.lm_head)
        b.drafts.copy_(drafts)
        if b.conf is not None and conf is not None:
            b.conf.copy_(conf)
