"""Decode and verify steps replayed from CUDA graphs, one graph per (batch-size bucket, tokens
per sequence, hidden rows kept) (SGLang's CudaGraphRunner, vLLM's capture sizes).

On a GPU a decode step of a small model is host-bound: every layer launches dozens of small
kernels, and Python's dispatch of them takes longer than they run. A graph captured once per
bucket replays them all from one launch. The captured forward reads static buffers: each step
copies its ForwardBatch into them, pads the batch up to the bucket with rows that run on the
pools' scratch slot and block (their outputs are dropped), and the block table is as wide as a
request may grow. So nothing captured may read a value back to the host or size a tensor by
data: the kernels bound their work by shapes alone (the paged MLA's splits by the block
table's width, the fused MoE's blocks by T * k + E * (BLOCK_M - 1)).

A verify step (speculative decoding) is a graph too when every sequence verifies the
configured number k of drafts (shorter verifies run eagerly: one verify graph per bucket):
1 + k tokens each, padding sequences of 1 + k tokens in the scratch block (so 1 + k may not
exceed the block size), the KDA step record the rollback replays and, for a block drafter,
the hidden rows it drafts from written to static buffers like the logits. The MLA kernel
learns that the step is a verify from `max_seqlen`, not by reading cu_seqlens. With
speculation on, the logits and record buffers hold max_bs * (1 + k) rows (allocated once,
outside the pools' memory budget).

Graphs are captured on first use of a key, with every row of the buffers padding, so the
warm-up runs touch only the scratch rows. Without CUDA (the tests) the runner replays the same
static-buffer forward eagerly: buffers, padding and buckets are checked on the CPU, the
capture itself only on a GPU.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import replace
from typing import NamedTuple

import torch

from kdaserve.cache.block_pool import BlockPool
from kdaserve.cache.state_pool import StatePool
from kdaserve.engine_config import DEFAULT_DRAFTS, EngineConfig
from kdaserve.forward_batch import ForwardBatch
from kdaserve.kernels import Kernels, graph_verify_tokens
from kdaserve.kernels.graphs import capture
from kdaserve.kernels.registry import GRAPH_SAFE
from kdaserve.layers.kda import FUSED_MAX_TOKENS, KDAttention
from kdaserve.models.kimi_linear import KimiLinearForCausalLM
from kdaserve.step_record import KDASteps, StepRecord

logger = logging.getLogger("kdaserve")


GRAPHED_OPS = ("kda_decode", "mla_attention", "moe_experts", "moe_route")


def graph_safe(kernels: Kernels) -> bool:
    """Whether a decode forward's kernels can sit in a graph: their backends say they read
    nothing back to the host (the triton backend's do; the references, on a CUDA machine
    without fla-core or with kernel_backend="ref", read sequence lengths and expert ids back,
    and capture would fail). The torch ops the other kernels are (projections, norms,
    SwiGLU) read nothing back."""
    return kernels.have(GRAPH_SAFE, GRAPHED_OPS)


def capture_sizes(max_bs: int) -> list[int]:
    """Batch-size buckets: 1, 2, 4, then every 8 up to max_bs (SGLang's list, cut there). A
    step pads to the next bucket: at most 7 wasted rows, each a few percent of a step."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_bs}")
    return sorted({s for s in (1, 2, 4) if s < max_bs} | set(range(8, max_bs, 8)) | {max_bs})


def verify_tokens(config: EngineConfig, model: KimiLinearForCausalLM, block_size: int) -> int:
    """The most tokens per sequence a verify graph takes: 1 + the drafts, where speculation
    is on and the verify can sit in a graph (padding in one scratch block, the fused KDA
    step and the absorbed MLA kernel, whose fla fallbacks read lengths back); else 1."""
    if config.speculative_algorithm is None:
        return 1
    # (K3's published drafters, whose width differs, verify eagerly: their taps are every
    # row's, which no graph keeps)
    q = 1 + (config.speculative_num_draft_tokens or DEFAULT_DRAFTS)
    kernels = graph_verify_tokens(m.head_dim for m in model.modules()
                                  if isinstance(m, KDAttention))
    return q if q <= min(block_size, FUSED_MAX_TOKENS, kernels) else 1


def graph_runner(config: EngineConfig, kernels: Kernels, model: KimiLinearForCausalLM,
                 states: StatePool, blocks: BlockPool, max_num_seqs: int,
                 max_context: int) -> CudaGraphRunner | None:
    """The engine's runner: on CUDA, unless disabled, where the kernels allow it and one
    rank steps alone (tensor- and expert-parallel engines' other ranks step eagerly; the
    config refuses cuda_graph_max_bs with them)."""
    if config.device.startswith("cuda") and not config.disable_cuda_graph and \
            graph_safe(kernels) and config.tp_size == 1 and not config.enable_dp_attention:
        return CudaGraphRunner(model, states, blocks, config.cuda_graph_max_bs or max_num_seqs,
                               max_context, verify_tokens(config, model, blocks.block_size))
    if config.cuda_graph_max_bs is not None:  # asked for, so not silently dropped
        raise ValueError("cuda_graph_max_bs: CUDA graphs need the triton kernel backend "
                         "(triton and fla-core importable); this engine runs eagerly")
    return None


class GraphKey(NamedTuple):
    bs: int  # sequences: a batch-size bucket
    q: int  # new tokens per sequence: 1 a decode, 1 + k a verify of k drafts
    hidden: tuple[int, ...] | None  # hidden rows kept: None none, () final-normed, taps


class CudaGraphRunner:
    """Decode forwards (one new token per sequence) and verify forwards (max_q = 1 + k tokens
    per sequence), logits for every row, of up to `max_bs` sequences whose contexts fit
    `max_context` tokens. `capture`: record CUDA graphs (False: replay the static-buffer
    forward eagerly, the CPU tests' mode)."""

    def __init__(self, model: KimiLinearForCausalLM, states: StatePool, blocks: BlockPool,
                 max_bs: int, max_context: int, max_q: int = 1, capture: bool = True) -> None:
        if not 1 <= max_q <= blocks.block_size:
            raise ValueError(f"verify graphs of {max_q} tokens per sequence need them in one "
                             f"scratch block of {blocks.block_size}")
        self.model, self.states, self.blocks = model, states, blocks
        self.sizes = capture_sizes(max_bs)
        self.max_bs, self.max_q, self.capture = max_bs, max_q, capture
        self.width = blocks.blocks_needed(max_context)
        self.dev = dev = model.embed_tokens.weight.device
        self.pad_row = blocks.scratch * blocks.block_size  # the scratch block's first token
        rows = max_bs * max_q

        def full(shape: tuple[int, ...], value: int) -> torch.Tensor:
            return torch.full(shape, value, dtype=torch.int64, device=dev)

        self.buffers = ForwardBatch(
            input_ids=full((rows,), 0), positions=full((rows,), 0),
            cu_seqlens=torch.arange(max_bs + 1, device=dev), context_lens=full((max_bs,), 1),
            state_slots=full((max_bs,), states.scratch),
            block_table=full((max_bs, self.width), blocks.scratch),
            slot_mapping=full((rows,), self.pad_row),
            logits_indices=torch.arange(rows, device=dev), is_decode=True, max_seqlen=1)
        self.cu = {1: self.buffers.cu_seqlens}  # per q: [0, q, 2q, ...]
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        # every graph writes its outputs here (one buffer each, not one per key): the logits,
        # the hidden rows per kind asked, and the KDA layers' step record
        self.logits = torch.empty(rows, model.config.vocab_size, dtype=torch.float32,
                                  device=dev)
        self.hidden: dict[tuple[int, ...], torch.Tensor] = {}
        self.record: list[KDASteps] = []
        self.pool = None  # the graphs' shared memory pool
        self.filled = 0  # sequence rows of the buffers holding the last step's sequences
        self.padded_q = 0  # the tokens per sequence the other rows are padding for
        self.failed = False  # a capture failed: every step runs eagerly from then on
        self.pad(0, max_bs, 1)

    def key(self, fb: ForwardBatch, hidden: tuple[int, ...] | None = None) -> GraphKey | None:
        """The graph for this batch, or None where it runs eagerly. A decode, or a verify of
        max_q tokens for every sequence with every row recorded; logits for every row
        and nothing else kept beside them but the hidden rows asked (snapshots and routing
        need the eager forward)."""
        B, T = fb.num_seqs, fb.num_tokens
        if self.failed or B > self.max_bs or fb.block_table.shape[1] > self.width \
                or fb.logits_indices.shape[0] != T or fb.snapshots is not None \
                or fb.routing is not None or fb.embed_rows is not None:
            return None
        q = 1 if fb.is_decode else fb.max_seqlen
        if q == 1:
            if fb.record is not None:
                return None
        # every sequence has q tokens when the longest has q and they sum to B * q
        elif not (1 < q == self.max_q and T == B * q and fb.record is not None
                  and fb.record.num_leading == T):
            return None
        return GraphKey(self.bucket(B), q, hidden)

    def bucket(self, n: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def view(self, key: GraphKey) -> ForwardBatch:
        """The first rows of the static buffers as the key's batch (views: a replay reads
        what the last `load` wrote)."""
        b, bs, q = self.buffers, key.bs, key.q
        if q not in self.cu:
            self.cu[q] = torch.arange(self.max_bs + 1, device=self.dev) * q
        t = bs * q
        return replace(b, input_ids=b.input_ids[:t], positions=b.positions[:t],
                       cu_seqlens=self.cu[q][:bs + 1], context_lens=b.context_lens[:bs],
                       state_slots=b.state_slots[:bs], block_table=b.block_table[:bs],
                       slot_mapping=b.slot_mapping[:t], logits_indices=b.logits_indices[:t],
                       is_decode=q == 1, max_seqlen=q, taps=key.hidden or (),
                       record=StepRecord(list(range(t)), {}, self.dev) if q > 1 else None)

    def load(self, fb: ForwardBatch, q: int) -> None:
        """Copies the batch into the buffers' first rows; rows the last step used past them
        become padding again (all rows, where the last step had other tokens per sequence)."""
        b, n, w = self.buffers, fb.num_seqs, fb.block_table.shape[1]
        t = fb.num_tokens
        for dst, src in ((b.input_ids[:t], fb.input_ids), (b.positions[:t], fb.positions),
                         (b.slot_mapping[:t], fb.slot_mapping),
                         (b.context_lens[:n], fb.context_lens),
                         (b.state_slots[:n], fb.state_slots)):
            dst.copy_(src, non_blocking=True)
        # columns past w keep stale block ids: a row never reads past its context
        b.block_table[:n, :w].copy_(fb.block_table, non_blocking=True)
        if q != self.padded_q:
            self.pad(n, self.max_bs, q)
        elif self.filled > n:
            self.pad(n, self.filled, q)
        self.filled = n

    def pad(self, lo: int, hi: int, q: int) -> None:
        """Sequence rows [lo, hi) become padding of q tokens each: positions 0..q-1 of a
        q-token context in the scratch block, on the scratch state slot."""
        b = self.buffers
        steps = torch.arange(q, device=self.dev).repeat(hi - lo)
        b.input_ids[lo * q:hi * q] = 0
        b.positions[lo * q:hi * q] = steps
        b.slot_mapping[lo * q:hi * q] = steps + self.pad_row
        b.context_lens[lo:hi] = q
        b.state_slots[lo:hi] = self.states.scratch
        b.block_table[lo:hi, 0] = self.blocks.scratch
        self.padded_q = q

    def forward(self, key: GraphKey, fb: ForwardBatch) -> None:
        """The key's forward on its view `fb`, its outputs written to the static buffers."""
        hidden = self.model.forward_hidden(fb, self.states, self.blocks)
        t = fb.num_tokens
        self.logits[:t].copy_(self.model.compute_logits(hidden))
        if key.hidden is not None:
            kept = fb.tapped if key.hidden else hidden
            assert kept is not None
            out = self.hidden.get(key.hidden)
            if out is None:
                out = self.hidden[key.hidden] = kept.new_empty(self.max_bs * self.max_q,
                                                                kept.shape[1])
            out[:t].copy_(kept)
        if fb.record is not None:
            if not self.record:
                self.record = [KDASteps(*(x.new_empty(self.max_bs * self.max_q, *x.shape[1:])
                                          for x in steps)) for steps in fb.record.layers]
            for buf, steps in zip(self.record, fb.record.layers, strict=True):
                for dst, src in zip(buf, steps, strict=True):
                    dst[:t].copy_(src)

    def run(self, fb: ForwardBatch, key: GraphKey
            ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """fp32 logits [T, vocab] and the hidden rows asked (or None) of a batch `key`
        accepted; a verify's `fb.record` then holds the KDA steps. All are views of the
        static buffers, overwritten by the next step: read before it. None where the key's
        capture failed: the caller runs the step eagerly."""
        if self.capture and key not in self.graphs:
            try:
                self._capture(key)
            except Exception:  # noqa: BLE001 - served eagerly, said once, loudly
                logger.exception("CUDA graph capture failed at %s: decode and verify steps "
                                 "run eagerly from now on", key)
                self.failed = True
                self.reset()
                self.pad(0, self.max_bs, 1)
                self.filled = 0
                return None
        self.load(fb, key.q)
        if self.capture:
            self.graphs[key].replay()
        else:
            self.forward(key, self.view(key))
        t = fb.num_tokens
        if fb.record is not None:
            fb.record.layers = [KDASteps(*(x[:t] for x in steps)) for steps in self.record]
        hidden = None if key.hidden is None else self.hidden[key.hidden][:t]
        return self.logits[:t], hidden

    def _capture(self, key: GraphKey) -> None:
        """Records the key's graph with every buffer row padding (the warm-up runs, which
        compile and autotune the kernels outside the capture, touch only the scratch rows)."""
        self.pad(0, self.max_bs, key.q)
        self.filled = 0
        fb = self.view(key)
        # the warm-ups on fresh views, the capture on fb (the views replays read)
        views = iter([self.view(key), self.view(key), fb])
        graph = capture(lambda: self.forward(key, next(views)), fb.input_ids.device, self.pool)
        self.pool = graph.pool()
        self.graphs[key] = graph

    def reset(self) -> None:
        """Drops every graph (they hold the addresses of tensors an RL memory release frees);
        they are recaptured on next use."""
        self.graphs.clear()
        self.pool = None
