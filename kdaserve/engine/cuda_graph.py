"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (SGLang's
CudaGraphRunner, vLLM's capture sizes).

On a GPU a decode step of a small model is host-bound: every layer launches dozens of small
kernels, and Python's dispatch of them takes longer than they run. A graph captured once per
bucket replays them all from one launch. The captured forward reads static buffers: each step
copies its ForwardBatch into them, pads the batch up to the bucket with rows that run on the
pools' scratch slot and block (their outputs are dropped), and the block table is as wide as a
request may grow. So nothing captured may read a value back to the host or size a tensor by
data: the kernels bound their work by shapes alone (the paged MLA's splits by the block
table's width, the fused MoE's blocks by T * k + E * (BLOCK_M - 1)).

Graphs are captured on first use of a bucket, with every row of the buffers padding, so the
warm-up runs touch only the scratch rows. Without CUDA (the tests) the runner replays the same
static-buffer forward eagerly: buffers, padding and buckets are checked on the CPU, the
capture itself only on a GPU.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import replace

import torch

from kdaserve.cache.block_pool import BlockPool
from kdaserve.cache.state_pool import StatePool
from kdaserve.config import EngineConfig
from kdaserve.forward_batch import ForwardBatch
from kdaserve.kernels import Kernels
from kdaserve.kernels.triton.kda import kda_decode_triton
from kdaserve.kernels.triton.mla import mla_attention_triton
from kdaserve.kernels.triton.moe import moe_experts_triton, moe_route_triton
from kdaserve.models.kimi_linear import KimiLinearForCausalLM

logger = logging.getLogger("kdaserve")


def graph_safe(kernels: Kernels) -> bool:
    """Whether a decode forward's kernels can sit in a graph: the triton backend's read
    nothing back to the host; the references (a CUDA machine without fla-core, or
    kernel_backend="ref") read sequence lengths and expert ids back, and capture would fail.
    The torch ops the other kernels are (projections, norms, SwiGLU) read nothing back."""
    return (kernels.kda_decode is kda_decode_triton
            and kernels.mla_attention is mla_attention_triton
            and kernels.moe_experts is moe_experts_triton
            and kernels.moe_route is moe_route_triton)


def capture_sizes(max_bs: int) -> list[int]:
    """Batch-size buckets: 1, 2, 4, then every 8 up to max_bs (SGLang's list, cut there). A
    step pads to the next bucket: at most 7 wasted rows, each a few percent of a step."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_bs}")
    return sorted({s for s in (1, 2, 4) if s < max_bs} | set(range(8, max_bs, 8)) | {max_bs})


def graph_runner(config: EngineConfig, kernels: Kernels, model: KimiLinearForCausalLM,
                 states: StatePool, blocks: BlockPool, max_num_seqs: int,
                 max_context: int) -> CudaGraphRunner | None:
    """The engine's runner: on CUDA, unless disabled, where the kernels allow it and one
    rank steps alone (tensor- and expert-parallel engines' other ranks step eagerly; the
    config refuses cuda_graph_max_bs with them)."""
    if config.device.startswith("cuda") and not config.disable_cuda_graph and \
            graph_safe(kernels) and config.tp_size == 1 and not config.enable_dp_attention:
        return CudaGraphRunner(model, states, blocks, config.cuda_graph_max_bs or max_num_seqs,
                               max_context)
    if config.cuda_graph_max_bs is not None:  # asked for, so not silently dropped
        raise ValueError("cuda_graph_max_bs: CUDA graphs need the triton kernel backend "
                         "(triton and fla-core importable); this engine runs eagerly")
    return None


class CudaGraphRunner:
    """Decode forwards (one new token per sequence, logits for every row) of up to `max_bs`
    sequences whose contexts fit `max_context` tokens. `capture`: record CUDA graphs (False:
    replay the static-buffer forward eagerly, the CPU tests' mode)."""

    def __init__(self, model: KimiLinearForCausalLM, states: StatePool, blocks: BlockPool,
                 max_bs: int, max_context: int, capture: bool = True) -> None:
        self.model, self.states, self.blocks = model, states, blocks
        self.sizes = capture_sizes(max_bs)
        self.max_bs, self.capture = max_bs, capture
        self.width = blocks.blocks_needed(max_context)
        dev = model.embed_tokens.weight.device
        pad_row = blocks.scratch * blocks.block_size  # the scratch block's first token

        def full(shape: tuple[int, ...], value: int) -> torch.Tensor:
            return torch.full(shape, value, dtype=torch.int64, device=dev)

        # every row starts as padding: position 0 of a one-token context in the scratch
        self.buffers = ForwardBatch(
            input_ids=full((max_bs,), 0), positions=full((max_bs,), 0),
            cu_seqlens=torch.arange(max_bs + 1, device=dev), context_lens=full((max_bs,), 1),
            state_slots=full((max_bs,), states.scratch),
            block_table=full((max_bs, self.width), blocks.scratch),
            slot_mapping=full((max_bs,), pad_row),
            logits_indices=torch.arange(max_bs, device=dev), is_decode=True, max_seqlen=1)
        self.pad_row = pad_row
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # every graph writes its logits here (one [max_bs, vocab] buffer, not one per bucket)
        self.logits = torch.empty(max_bs, model.config.vocab_size, dtype=torch.float32,
                                  device=dev) if capture else None
        self.pool = None  # the graphs' shared memory pool
        self.filled = 0  # rows of the buffers holding the last step's sequences
        self.failed = False  # a capture failed: every step runs eagerly from then on

    def takes(self, fb: ForwardBatch) -> bool:
        """A plain decode step: one token per sequence, every row's logits, nothing kept
        beside them (verify records, snapshots, routing, taps need the eager forward)."""
        return (not self.failed and fb.is_decode and fb.num_seqs <= self.max_bs
                and fb.block_table.shape[1] <= self.width
                and fb.logits_indices.shape[0] == fb.num_seqs
                and fb.record is None and fb.snapshots is None and fb.routing is None
                and not fb.taps)

    def bucket(self, n: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def view(self, bs: int) -> ForwardBatch:
        """The first `bs` rows of the static buffers as a batch (views: a replay reads what
        the last `load` wrote)."""
        b = self.buffers
        return replace(b, input_ids=b.input_ids[:bs], positions=b.positions[:bs],
                       cu_seqlens=b.cu_seqlens[:bs + 1], context_lens=b.context_lens[:bs],
                       state_slots=b.state_slots[:bs], block_table=b.block_table[:bs],
                       slot_mapping=b.slot_mapping[:bs], logits_indices=b.logits_indices[:bs])

    def load(self, fb: ForwardBatch) -> None:
        """Copies the batch into the buffers' first rows; rows the last step used past them
        become padding again."""
        b, n, w = self.buffers, fb.num_seqs, fb.block_table.shape[1]
        for dst, src in ((b.input_ids, fb.input_ids), (b.positions, fb.positions),
                         (b.context_lens, fb.context_lens), (b.state_slots, fb.state_slots),
                         (b.slot_mapping, fb.slot_mapping)):
            dst[:n].copy_(src, non_blocking=True)
        # columns past w keep stale block ids: a row never reads past its context
        b.block_table[:n, :w].copy_(fb.block_table, non_blocking=True)
        if self.filled > n:
            self.pad(n, self.filled)
        self.filled = n

    def pad(self, lo: int, hi: int) -> None:
        b = self.buffers
        b.input_ids[lo:hi] = 0
        b.positions[lo:hi] = 0
        b.context_lens[lo:hi] = 1
        b.state_slots[lo:hi] = self.states.scratch
        b.block_table[lo:hi, 0] = self.blocks.scratch
        b.slot_mapping[lo:hi] = self.pad_row

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        return self.model.compute_logits(
            self.model.forward_hidden(fb, self.states, self.blocks))

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """fp32 logits [B, vocab] of a batch `takes` accepted."""
        n = fb.num_seqs
        bs = self.bucket(n)
        if self.capture and bs not in self.graphs:
            try:
                self._capture(bs)
            except Exception:  # noqa: BLE001 - served eagerly, said once, loudly
                logger.exception("CUDA graph capture failed at batch size %d: decode steps "
                                 "run eagerly from now on", bs)
                self.failed = True
                self.reset()
                return self.forward(fb)
        self.load(fb)
        if not self.capture:
            return self.forward(self.view(bs))[:n]
        self.graphs[bs].replay()
        assert self.logits is not None
        return self.logits[:n]  # overwritten by the next replay: read before it

    def _capture(self, bs: int) -> None:
        """Records the bucket's graph with every buffer row padding (the warm-up runs, which
        compile and autotune the kernels outside the capture, touch only the scratch rows)."""
        self.pad(0, self.max_bs)
        self.filled = 0
        fb = self.view(bs)
        with torch.cuda.device(fb.input_ids.device):  # the engine's GPU, not the default one
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.forward(fb)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            assert self.logits is not None
            # thread_local: CUDA calls other threads make meanwhile (a weight-sync rendezvous,
            # a transfer engine's workers) do not invalidate the capture
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self.logits[:bs].copy_(self.forward(fb))
        self.pool = graph.pool()
        self.graphs[bs] = graph

    def reset(self) -> None:
        """Drops every graph (they hold the addresses of tensors an RL memory release frees);
        they are recaptured on next use."""
        self.graphs.clear()
        self.pool = None
