"""Draft-model drafter: a smaller checkpoint with the target's vocabulary, run by the engine
itself with its own KDA state pool and MLA block pool.

Per request the draft caches hold a prefix of the request's tokens (`num_computed`). A propose
runs, in one batched forward, every token the draft has not seen yet (the prompt, lazily, on
the first propose; then the tokens accepted since) ending with the pending last token, whose
logits give draft 0; drafts 1..k-1 take one batched decode forward each. The last draft is
never run, so after drafting the draft caches are one token behind the drafts.

Rollback. A recurrent state cannot be truncated, so the draft slot is copied to a scratch slot
right before the decode forwards (the state after exactly the request's context). After
verification, if the drafts run into the state are still a prefix of the request's tokens
(short of the new pending token) nothing happens: the next propose only runs the tokens
after them. Otherwise the scratch copy is restored and the accepted tokens plus the target's
token are replayed by the next propose's first forward, where they ride along with the pending
token at almost no cost. This was chosen over keeping the draft one token behind by
construction: the restore + replay costs one slot copy per step, and the check against the
request's actual tokens also covers drafts the scheduler truncated or dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from kdaserve.cache.block_pool import BlockPool
from kdaserve.cache.state_pool import StatePool
from kdaserve.config import ModelConfig
from kdaserve.forward_batch import ForwardBatch
from kdaserve.kernels import Kernels
from kdaserve.models.kimi_linear import KimiLinearForCausalLM
from kdaserve.models.loader import build_model, checkpoint_bytes, load_weights
from kdaserve.request import Request
from kdaserve.speculative.drafter import Drafter


def pool_blocks(max_tokens: int, block_size: int, k: int, max_running: int) -> int:
    """The draft's KV blocks: it never shares blocks, so as many as the target's KV capacity
    (max_tokens) plus room for every running request's drafts."""
    return -(-max_tokens // block_size) + max_running * (-(-k // block_size) + 1)


def memory_plan(path: Path, dtype: torch.dtype, block_size: int, k: int,
                max_running: int) -> tuple[int, int]:
    """(bytes per KV block of the target, bytes besides) the draft model at path takes, for
    the engine's memory plan (engine/pools.py): a block of its own latents beside each of the
    target's, and its weights, state slots and the drafts' extra blocks."""
    config = ModelConfig.from_pretrained(path)
    per_block = BlockPool.bytes_per_block(config, block_size, dtype)
    slots = (2 * max_running + 1) * StatePool.bytes_per_slot(config, dtype)
    extra = (pool_blocks(0, block_size, k, max_running) + 1) * per_block  # + the scratch
    return per_block, checkpoint_bytes(path, dtype) + slots + extra


@dataclass(slots=True)
class DraftSeq:
    """A request's draft caches."""

    slot: int
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # the request's first num_computed tokens are in the draft caches
    scratch: int | None = None  # draft state after the context, before the draft tokens
    snap_pos: int = 0  # num_computed at the snapshot
    ran: list[int] = field(default_factory=list)  # draft tokens run since the snapshot
    drafted_at: int = -1  # the request's length when it last drafted
    drafts: list[int] = field(default_factory=list)  # and what it drafted then


class DraftModelDrafter(Drafter):
    def __init__(self, model: KimiLinearForCausalLM, k: int, max_running: int, num_blocks: int,
                 block_size: int, max_chunk: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        if k < 1:
            raise ValueError(f"speculative_num_draft_tokens must be >= 1, got {k}")
        self.model, self.k, self.device, self.max_chunk = model, k, device, max_chunk
        # a working slot per running request + its rollback snapshot
        self.states = StatePool(model.config, 2 * max_running, dtype, device)
        self.blocks = BlockPool(model.config, num_blocks, block_size, dtype, device)
        self.seqs: dict[int, DraftSeq] = {}  # id(req) -> its draft caches
        self.path: Path | None = None  # where `load` read it (RL reloads its weights there)
        self._shapes = [p.shape for p in model.parameters()]

    @classmethod
    def load(cls, path: Path, target: ModelConfig, kernels: Kernels, dtype: torch.dtype,
             device: torch.device, k: int, max_running: int, max_tokens: int, block_size: int,
             max_chunk: int) -> DraftModelDrafter:
        """max_tokens: the target's KV capacity; the draft never shares blocks, so it gets as
        many plus room for every running request's drafts."""
        config = ModelConfig.from_pretrained(path)
        if config.vocab_size != target.vocab_size:
            raise ValueError(f"draft model {path} has vocab_size {config.vocab_size}, the "
                             f"target {target.vocab_size}: a draft must share the vocabulary")
        model = build_model(config, kernels, dtype, device, path)
        drafter = cls(model, k, max_running, pool_blocks(max_tokens, block_size, k, max_running),
                      block_size, max_chunk, dtype, device)
        drafter.path = Path(path)
        return drafter

    # ---- proposing ----
    def propose(self, reqs: list[Request]) -> None:
        budget = self.max_chunk
        first: list[tuple[Request, DraftSeq, int]] = []  # (req, seq, tokens run now)
        seqs = []
        for req in reqs:
            req.draft_ids = []
            seq = self._seq(req)
            if seq is not None:
                seqs.append((req, seq))
        # requests already caught up first: a long lazy prefill takes what budget is left
        seqs.sort(key=lambda rs: rs[0].num_tokens - rs[1].num_computed)
        for req, seq in seqs:
            if req.num_tokens == seq.drafted_at:  # not scheduled since: same context, drafts
                req.draft_ids = seq.drafts[:self.max_draft_tokens(req)]
                continue
            if budget == 0:
                continue
            todo = req.num_tokens - seq.num_computed
            n = min(todo, budget)
            # drafting needs room for the context and k - 1 draft tokens; catch-up only n
            need = seq.num_computed + n + (self.max_draft_tokens(req) - 1 if n == todo else 0)
            if not self._grow(seq, need):
                continue
            first.append((req, seq, n))
            budget -= n
        if not first:
            return
        # 1. the unseen tokens of each request, ending (when complete) with the pending token
        done = [seq.num_computed + n == req.num_tokens for req, seq, n in first]
        logits = self._forward([req.all_ids[seq.num_computed:seq.num_computed + n]
                                for req, seq, n in first], [seq for _, seq, _ in first], done)
        for _, seq, n in first:
            seq.num_computed += n
        drafting = [(req, seq) for (req, seq, _), d in zip(first, done, strict=True) if d]
        for (req, seq), t in zip(drafting, logits.argmax(-1).tolist(), strict=True):
            req.draft_ids = [t]
            if self.max_draft_tokens(req) > 1:  # decode forwards follow: snapshot first
                seq.scratch = self.states.allocate(zero=False)
                self.states.copy(seq.slot, seq.scratch)
                seq.snap_pos = seq.num_computed
        # 2. drafts 1..k-1: one batched decode forward each
        while True:
            active = [(r, s) for r, s in drafting if len(r.draft_ids) < self.max_draft_tokens(r)]
            if not active:
                break
            last = [[r.draft_ids[-1]] for r, _ in active]
            logits = self._forward(last, [s for _, s in active], [True] * len(active))
            for (r, s), tok, t in zip(active, last, logits.argmax(-1).tolist(), strict=True):
                s.ran.append(tok[0])
                s.num_computed += 1
                r.draft_ids.append(t)
        for req, seq in drafting:
            seq.drafted_at, seq.drafts = req.num_tokens, list(req.draft_ids)

    @torch.inference_mode()
    def _forward(self, tokens: list[list[int]], seqs: list[DraftSeq],
                 sample: list[bool]) -> torch.Tensor:
        fb = ForwardBatch.build(tokens, [s.num_computed for s in seqs], [s.slot for s in seqs],
                                [s.block_ids for s in seqs], self.blocks.block_size,
                                sample=sample, device=self.device)
        return self.model(fb, self.states, self.blocks)

    def _seq(self, req: Request) -> DraftSeq | None:
        """req's draft caches, rolled back to what its tokens confirm; None if the pool is
        full (the request then decodes without drafts)."""
        seq = self.seqs.get(id(req))
        if seq is None:
            if self.states.num_free < 2:  # its working slot and a snapshot slot
                return None
            seq = self.seqs[id(req)] = DraftSeq(self.states.allocate())
        self._sync(req, seq)
        return seq

    def _grow(self, seq: DraftSeq, num_tokens: int) -> bool:
        need = self.blocks.blocks_needed(num_tokens) - len(seq.block_ids)
        if need > self.blocks.num_free:
            return False
        if need > 0:
            seq.block_ids.extend(self.blocks.allocate(need))
        return True

    def _sync(self, req: Request, seq: DraftSeq) -> None:
        """Resolves the last drafting: keeps the draft tokens run into the state if the
        request accepted them (and has a newer pending token), else restores the snapshot.
        Nothing to resolve while the request has not moved (its drafts were not verified)."""
        if seq.scratch is None or req.num_tokens == seq.drafted_at:
            return
        end = seq.snap_pos + len(seq.ran)
        ids = req.all_ids
        if not (end < len(ids) and ids[seq.snap_pos:end] == seq.ran):
            self.states.copy(seq.scratch, seq.slot)
            seq.num_computed = seq.snap_pos  # the replay rides on the next first forward
        self.states.free(seq.scratch)
        seq.scratch, seq.ran = None, []

    # ---- lifecycle ----
    def on_accept(self, req: Request, num_accepted: int,
                  hidden: torch.Tensor | None = None) -> None:
        seq = self.seqs.get(id(req))
        if seq is not None:
            self._sync(req, seq)  # frees the snapshot slot at once

    def on_finish(self, req: Request) -> None:
        seq = self.seqs.pop(id(req), None)
        if seq is None:
            return
        for slot in (seq.slot, seq.scratch):
            if slot is not None:
                self.states.free(slot)
        if seq.block_ids:
            self.blocks.free(seq.block_ids)

    def release_memory(self, tag: str) -> None:
        assert not self.seqs, "RL releases memory only with the engine idle"
        if tag == "kv_cache":
            self.blocks.release()
            self.states.release()
        elif tag == "weights":
            for p in self.model.parameters():
                p.data = p.data.new_empty(0)

    def resume_memory(self, tag: str) -> None:
        if tag == "kv_cache":
            self.blocks.resume()
            self.states.resume()
        elif tag == "weights" and self.path is not None:
            for p, shape in zip(self.model.parameters(), self._shapes, strict=True):
                p.data = p.data.new_empty(shape)
            load_weights(self.model, self.path)

    def check_integrity(self, idle: bool = False) -> None:
        """The draft pools hold exactly what the tracked requests own."""
        assert not (idle and self.seqs), "draft caches of finished requests not released"
        self.states.check_integrity()
        self.blocks.check_integrity()
        slots = [s.slot for s in self.seqs.values()]
        slots += [s.scratch for s in self.seqs.values() if s.scratch is not None]
        assert len(slots) == len(set(slots)), "draft state slot held twice"
        assert len(slots) == self.states.num_slots - self.states.num_free, "draft slot leak"
        blocks = [b for s in self.seqs.values() for b in s.block_ids]
        assert len(blocks) == len(set(blocks)), "draft block held twice"
        assert len(blocks) == self.blocks.num_blocks - self.blocks.num_free, "draft block leak"
