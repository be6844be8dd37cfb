"""ModelRunner: ScheduledBatch -> ForwardBatch -> model -> logits of the requests to sample.

The one place (with kernels/) where device-specific execution would live.
"""

from __future__ import annotations

import torch

from kdaserve.cache.block_pool import BlockPool
from kdaserve.cache.state_pool import StatePool
from kdaserve.engine.scheduler import ScheduledBatch
from kdaserve.forward_batch import ForwardBatch
from kdaserve.models.kimi_linear import KimiLinearForCausalLM
from kdaserve.request import Request
from kdaserve.spec.record import StepRecord


class ModelRunner:
    def __init__(self, model: KimiLinearForCausalLM, blocks: BlockPool, states: StatePool,
                 device: torch.device) -> None:
        self.model, self.blocks, self.states, self.device = model, blocks, states, device

    def prepare(self, batch: ScheduledBatch) -> tuple[ForwardBatch, list[Request]]:
        """Packs the batch; also returns the requests whose next token is sampled this step
        (decodes and final prefill chunks), in logits-row order."""
        new_tokens, num_cached, sample, num_logits = [], [], [], []
        for req, n in zip(batch.reqs, batch.num_new_tokens, strict=True):
            start = req.num_computed_tokens
            ids = req.all_ids + req.draft_ids  # drafted tokens are verified in this forward
            new_tokens.append(ids[start:start + n])
            num_cached.append(start)
            sample.append(start + n == len(ids))
            num_logits.append(1 + len(req.draft_ids))
        fb = ForwardBatch.build(new_tokens, num_cached, [r.state_slot for r in batch.reqs],
                                [r.block_ids for r in batch.reqs], self.blocks.block_size,
                                sample=sample, num_logits=num_logits, device=self.device)
        if batch.snapshots:
            index = {id(r): i for i, r in enumerate(batch.reqs)}
            cols = ([index[id(r)] for r, _, _ in batch.snapshots],
                    [p - r.num_computed_tokens for r, p, _ in batch.snapshots],
                    [s for _, _, s in batch.snapshots])
            seqs, n, slots = (torch.tensor(c, dtype=torch.int64, device=self.device)
                              for c in cols)
            fb.snapshots = (seqs, n, slots)
        return fb, [r for r, s in zip(batch.reqs, sample, strict=True) if s]

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, return_hidden: bool = False,
            record: StepRecord | None = None,
            ) -> tuple[torch.Tensor, list[Request], torch.Tensor | None]:
        """logits [L, vocab] of the rows to sample, those requests, and with return_hidden
        their final hidden states [L, D] (the same forward: results do not change). With
        `record`, the KDA layers fill it with their step inputs."""
        fb, to_sample = self.prepare(batch)
        fb.record = record
        hidden = self.model.forward_hidden(fb, self.states, self.blocks)
        logits = self.model.compute_logits(hidden)
        for req, n in zip(batch.reqs, batch.num_new_tokens, strict=True):
            req.num_computed_tokens += n
        return logits, to_sample, hidden if return_hidden else None

    @torch.inference_mode()
    def replay(self, record: StepRecord, replays: list[tuple[Request, int]]) -> None:
        """Advances each request's KDA states by its first n recorded steps (req, n), one
        kda_chunk per KDA layer for all of them."""
        rows, cu = record.spans([(record.starts[id(r)], n) for r, n in replays], self.device)
        slots = torch.tensor([r.state_slot for r, _ in replays], dtype=torch.int64,
                             device=self.device)
        self.model.replay_kda(record, rows, cu, slots, self.states)
