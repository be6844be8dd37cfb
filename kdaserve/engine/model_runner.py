"""ModelRunner: ScheduledBatch -> ForwardBatch -> model -> logits of the requests to sample.

The one place (with kernels/) where device-specific execution would live.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kdaserve.cache.block_pool import BlockPool
from kdaserve.cache.state_pool import StatePool
from kdaserve.engine.cuda_graph import CudaGraphRunner
from kdaserve.engine.native_decode import NativeDecode
from kdaserve.engine.placeholders import resolve_inputs
from kdaserve.engine.tensor_parallel import Followers
from kdaserve.forward_batch import ForwardBatch
from kdaserve.models.kimi_linear import KimiLinearForCausalLM
from kdaserve.models.vision import VisionModel, tower_calls
from kdaserve.request import Request
from kdaserve.scheduled_batch import ScheduledBatch
from kdaserve.step_record import StepRecord


def record_routing(batch: ScheduledBatch, ids: torch.Tensor) -> None:
    """Appends each asking request's new positions' experts ([T, layers, k] rows of this
    forward), once per position: a recomputed one (after preemption) is not added twice."""
    row = 0
    for req, n in zip(batch.reqs, batch.num_new_tokens, strict=True):
        p = req.options
        if p.return_routed_experts:
            first = req.num_computed_tokens  # absolute position of this chunk's first row
            want = p.routed_experts_start + req.num_routed
            a = max(want - first, 0)
            if a < n:
                req.routed_experts.append(ids[row + a:row + n].clone())  # not the batch's
                req.num_routed += n - a
        row += n


def record_hidden(req: Request, pos: int, block: torch.Tensor) -> None:
    """Appends the rows of `block` (positions pos, pos + 1, ...) not recorded yet: after a
    preemption the recomputed positions are not added twice."""
    a = max(req.num_hidden - pos, 0)
    if a < block.shape[0]:
        req.hidden_states.append(block[a:].float().cpu().clone())
        req.num_hidden += block.shape[0] - a


class Rows(NamedTuple):
    """One request's rows among a forward's returned hidden states."""
    req: Request
    pos: int  # absolute position of the first
    size: int
    prompt_at: int  # prompt-logprob rows [prompt_at, prompt_at + prompt_k) of the block
    prompt_k: int
    sampled: int  # the last `sampled` rows produce logits (1 + drafts), 0 if none


class StepOutput(NamedTuple):
    logits: torch.Tensor  # [L, vocab] fp32, the rows that sample, in `to_sample` order
    to_sample: list[Request]
    hidden: torch.Tensor | None  # [L, D] final hidden states of those rows, when asked
    prompt: list[tuple[Request, torch.Tensor]]  # prompt-logprob rows' hidden states


class ModelRunner:
    def __init__(self, model: KimiLinearForCausalLM, blocks: BlockPool, states: StatePool,
                 device: torch.device, followers: Followers | None = None,
                 vision: VisionModel | None = None, tower_per_image: bool = False) -> None:
        self.model, self.blocks, self.states, self.device = model, blocks, states, device
        self.followers = followers  # tensor-parallel ranks running every forward with us
        self.graphs: CudaGraphRunner | None = None  # decode and verify steps replayed (CUDA)
        # plain decode batches in one native call where every op is the native kernel anyway
        self.native_decode = NativeDecode.for_model(model)
        self.vision = vision  # K3's tower, for requests with images
        self.tower_per_image = tower_per_image  # a tower call per image (deterministic)

    def image_rows(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The images' rows at the pads this step runs (the input embeddings they replace),
        each request's computed once, when a chunk first reaches one of its pads: all such
        requests' images in as few tower calls as `tower_calls` allows."""
        assert self.vision is not None
        spans, at = [], 0
        for req, n in zip(batch.reqs, batch.num_new_tokens, strict=True):
            start = req.num_computed_tokens
            im = req.images
            if im is not None and start <= int(im.pad_positions[-1]) \
                    and start + n > int(im.pad_positions[0]):  # the chunk runs a pad
                spans.append((req, at, start, min(start + n, len(req.prompt_ids))))
            at += n
        if not spans:
            self._passed(batch)
            return None
        todo = list({id(r.images): r.images for r, *_ in spans if r.images.rows is None}
                    .values())
        flat = [p for im in todo for p in im.images]
        if flat:
            calls = tower_calls([p.grid for p in flat], self.tower_per_image)
            rows = torch.cat([self.vision(torch.cat([p.pixels for p in flat[i:j]])
                                          .to(self.device), [p.grid for p in flat[i:j]])
                              for i, j in calls])
            for im in todo:
                im.rows, rows = rows[:im.pad_positions.numel()], rows[im.pad_positions.numel():]
        index, values = [], []
        for req, at, start, end in spans:
            assert req.images is not None
            offsets, rows = req.images.rows_for(start, end)
            index.append(offsets.to(self.device) + at)
            values.append(rows)
        out = torch.cat(index), torch.cat(values)  # a copy: the rows may go now
        self._passed(batch)
        return out

    @staticmethod
    def _passed(batch: ScheduledBatch) -> None:
        """Counts the requests this step takes past their images' last pad, by running it or
        by starting past it (a sibling resumed from the prefix cache): once none of the
        siblings is left to, the rows go."""
        for req, n in zip(batch.reqs, batch.num_new_tokens, strict=True):
            im = req.images
            if im is not None and not req.passed_images \
                    and req.num_computed_tokens + n > int(im.pad_positions[-1]):
                req.passed_images = True
                im.pending -= 1
                if im.pending <= 0:
                    im.rows = None

    def prepare(self, batch: ScheduledBatch) -> tuple[ForwardBatch, list[Request],
                                                      list[Rows]]:
        """Packs the batch; also returns the requests whose next token is sampled this step
        (decodes and final prefill chunks), in logits-row order, and where each request's
        rows lie among the hidden states the forward returns."""
        new_tokens, num_cached, sample, logits_from = [], [], [], []
        layout: list[Rows] = []
        for req, n in zip(batch.reqs, batch.num_new_tokens, strict=True):
            start = req.num_computed_tokens
            # drafted tokens are verified in this forward
            new_tokens.append(req.tokens(start, start + n))
            num_cached.append(start)
            sampled = start + n == req.num_tokens + len(req.draft_ids)
            sample.append(sampled)
            first = n - 1 - len(req.draft_ids) if sampled else n
            row, prompt_at, prompt_k = req.prompt_logits_row, 0, 0
            if row is not None and row < start + n:
                # the scheduler never takes these rows from the cache (max_cached_prefix)
                assert row >= start, "prompt-logprob rows were skipped"
                end = min(len(req.prompt_ids) - 1, start + n)  # the last row samples
                prompt_at, prompt_k = row - start, end - row
            if req.options.return_hidden_states:  # every row not recorded yet
                assert req.num_hidden >= start, "hidden-state rows were skipped"
                first = min(first, req.num_hidden - start)
            if prompt_k:
                first = min(first, prompt_at)
            logits_from.append(first)
            layout.append(Rows(req, start + first, n - first, prompt_at - first, prompt_k,
                               1 + len(req.draft_ids) if sampled else 0))
        fb = ForwardBatch.build(new_tokens, num_cached, [r.state_slot for r in batch.reqs],
                                [r.block_ids for r in batch.reqs], self.blocks.block_size,
                                logits_from=logits_from, device=self.device)
        if self.vision is not None:
            fb.embed_rows = self.image_rows(batch)
        if batch.snapshots:
            index = {id(r): i for i, r in enumerate(batch.reqs)}
            cols = ([index[id(r)] for r, _, _ in batch.snapshots],
                    [p - r.num_computed_tokens for r, p, _ in batch.snapshots],
                    [s for _, _, s in batch.snapshots])
            seqs, n, slots = (torch.tensor(c, dtype=torch.int64, device=self.device)
                              for c in cols)
            fb.snapshots = (seqs, n, slots)
        return fb, [r for r, s in zip(batch.reqs, sample, strict=True) if s], layout

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, return_hidden: tuple[int, ...] | None = None,
            record: StepRecord | None = None, future: torch.Tensor | None = None,
            context_stream: str | None = None) -> StepOutput:
        """One forward. Logits are computed here only for the rows that sample; prompt-logprob
        rows come back as hidden states, whose logits the caller computes in slices (a long
        chunk's full [T, vocab] logits would not fit). With `record`, the KDA layers fill it
        with their step inputs. return_hidden: None, or the sampling rows' hidden states
        to return: () the final-normed ones, layer indices those layers' (a drafter's taps).
        future: the sampled tokens of the step in flight, which placeholder inputs stand for
        (engine/overlap.py). context_stream: a context drafter's (`Drafter.context_stream`):
        the taps of every new row in that stream, not the sampling rows'."""
        fb, to_sample, layout = self.prepare(batch)
        if future is not None:
            fb.input_ids = resolve_inputs(fb.input_ids, future)
        fb.record = record
        fb.taps = return_hidden or ()
        if context_stream is not None:
            fb.tap_all_rows, fb.tap_stream = True, context_stream
        if any(r.options.return_routed_experts for r in batch.reqs):
            fb.routing = []
        # every row samples (a prompt-logprob row of a one-token chunk is a decode-shaped
        # row that does not) and nothing but the logits (and a drafter's rows) comes back
        key = self.graphs.key(fb, return_hidden) if self.graphs is not None \
            and context_stream is None and len(to_sample) == fb.num_seqs \
            and not any(x.prompt_k for x in layout) \
            and not any(r.options.return_hidden_states for r in batch.reqs) else None
        # the graph's own buffers (and, for a verify, the record's): read before the next step
        replayed = self.graphs.run(fb, key) if self.graphs is not None and key is not None \
            else None
        if replayed is not None:
            logits, kept = replayed
            for req, n in zip(batch.reqs, batch.num_new_tokens, strict=True):
                req.num_computed_tokens += n
            # a drafter keeps its rows past this step (a request left out of the next step
            # drafts from them later): its own copy, not the graph's buffer
            return StepOutput(logits, to_sample, None if kept is None else kept.clone(), [])
        if self.followers is not None:
            self.followers.forward(fb, self.states)
        hidden = self.forward_hidden(fb)
        prompt: list[tuple[Request, torch.Tensor]] = []
        if any(x.size > x.sampled or x.req.options.return_hidden_states for x in layout):
            # per sequence a block of rows: prompt-logprob rows and hidden states to keep
            # inside it, its sampling rows last; the logits are the sampling rows only
            keep, row = [], 0
            for x in layout:
                block = hidden[row:row + x.size]
                if x.prompt_k:
                    prompt.append((x.req, block[x.prompt_at:x.prompt_at + x.prompt_k]))
                if x.req.options.return_hidden_states:
                    record_hidden(x.req, x.pos, block)
                keep.extend(range(row + x.size - x.sampled, row + x.size))
                row += x.size
            hidden = hidden[keep]
            if fb.tapped is not None and not fb.tap_all_rows:
                fb.tapped = fb.tapped[keep]
        logits = self.model.compute_logits(hidden)
        if fb.routing:
            record_routing(batch, torch.stack(fb.routing, 1).cpu())
        for req, n in zip(batch.reqs, batch.num_new_tokens, strict=True):
            req.num_computed_tokens += n
        if return_hidden is None:
            return StepOutput(logits, to_sample, None, prompt)
        return StepOutput(logits, to_sample, fb.tapped if return_hidden else hidden, prompt)

    def weights_replaced(self) -> None:
        """The model's weight tensors may have new storage (RL's release, resume, updates):
        what holds their addresses plans again (the one-call decode forward)."""
        if self.native_decode is not None:
            self.native_decode.invalidate()

    @torch.inference_mode()
    def forward_hidden(self, fb: ForwardBatch) -> torch.Tensor:
        """The model's final-normed hidden states of the logits rows: a plain decode batch in
        one native call where it applies (bit-equal to the per-op forward), else per op."""
        if self.native_decode is not None and self.native_decode.takes(fb):
            out = self.native_decode(fb, self.states, self.blocks)
            if out is not None:
                return out
        return self.model.forward_hidden(fb, self.states, self.blocks)

    def replay(self, record: StepRecord, replays: list[tuple[Request, int]]) -> None:
        """Advances each request's KDA states by its first n recorded steps (req, n): every
        KDA layer runs its fused decode step over them, token by token (KDAttention.replay_steps),
        all requests in one call."""
        rows, cu = record.spans([(record.starts[id(r)], n) for r, n in replays], self.device)
        slots = torch.tensor([r.state_slot for r, _ in replays], dtype=torch.int64,
                             device=self.device)
        if self.followers is not None:
            self.followers.replay(rows, cu, slots, self.states)
        self.model.replay_kda(record, rows, cu, slots, self.states)
