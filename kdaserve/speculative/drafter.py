"""The drafter interface: every speculative drafter (n-gram, draft model, block) is a `Drafter`.

The engine calls `propose` once per step with the decoding requests that may speculate; a
drafter fills `req.draft_ids` (at most `max_draft_tokens(req)` tokens; fewer or none is fine).
Drafts must be a deterministic function of the context: verification treats each draft as a
point mass, which keeps rejection sampling lossless. Drafters with per-request state (a draft
model's KDA slot and KV blocks, the block drafter's target hidden state) keep it in sync
through the lifecycle hooks, all no-ops by default.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch

    from kdaserve.request import Request


class Drafter:
    k: int  # most drafts per request and step
    # the engine then passes each sampled request's final hidden state row to on_accept
    wants_hidden: ClassVar[bool] = False
    # with wants_hidden: () passes the final-normed row (what the LM head sees); layer indices
    # pass instead the residual stream after each of those target layers, concatenated
    taps: tuple[int, ...] = ()
    # a drafter that keeps a context of taps (every committed position, not the newest only):
    # the target stream it reads (ForwardBatch.tap_stream), and the Speculator then hands
    # each request's committed rows to on_context after every forward
    context_stream: str | None = None
    # the schedule's cap on this step's drafts per request (None: k); drafts past it would
    # not be verified, so a drafter whose cost grows with the block drafts no further
    limit: int | None = None

    def propose(self, reqs: list[Request]) -> None:
        """Fills req.draft_ids for each request (as many as it has: the engine's schedule,
        `speculative/schedule.py`, picks how many to verify)."""
        raise NotImplementedError

    def survival(self, req: Request) -> list[float] | None:
        """The drafter's own estimate, per draft of its last proposal for req, of the chance
        that the draft and all before it are accepted; None: the engine estimates it."""
        return None

    def max_draft_tokens(self, req: Request) -> int:
        """Drafts worth proposing: k (or the schedule's limit), but never past max_tokens
        (the bonus token counts)."""
        k = self.k if self.limit is None else min(self.k, self.limit)
        return max(min(k, req.params.max_tokens - len(req.output_ids) - 1), 0)

    # ---- lifecycle (per-request drafter state) ----
    def on_admit(self, req: Request) -> None:
        """req was admitted to the running batch (fresh, or again after a preemption)."""

    def on_accept(self, req: Request, num_accepted: int,
                  hidden: torch.Tensor | None = None) -> None:
        """req sampled its next token(s) this step: num_accepted of its drafts were kept, plus
        one target token. hidden: [D] target final hidden state at the last computed position
        (the one whose logits gave the newest token), or [len(taps) * D] its tapped rows,
        when `wants_hidden`."""

    def on_context(self, req: Request, rows: torch.Tensor, start: int) -> None:
        """With `context_stream`: the taps [m, len(taps) * D] of req's positions start ..
        start + m - 1, which this step committed (a prefill chunk's, or a verify's anchor and
        accepted drafts)."""

    def on_release(self, req: Request) -> None:
        """req's KV blocks are about to be released (it finished or was preempted; the prefix
        cache may keep them): state kept in them is written now."""

    def on_finish(self, req: Request) -> None:
        """req finished (stop or length): release its drafter state."""

    def on_abort(self, req: Request) -> None:
        self.on_finish(req)

    def on_preempt(self, req: Request) -> None:
        """req lost its caches and will be recomputed: drafter state must go too."""
        self.on_finish(req)

    def check_integrity(self, idle: bool = False) -> None:
        """Asserts the drafter's own state is consistent; idle: no request is running, so
        it must hold nothing."""

    def release_memory(self, tag: str) -> None:
        """The engine is idle and RL's release_memory_occupation frees `tag` ("kv_cache" or
        "weights"): free what the drafter keeps of that kind."""

    def resume_memory(self, tag: str) -> None:
        """`tag` is back (the KV cache empty, the weights reloaded): so is what
        `release_memory` freed."""


class TokenDrafter(Drafter):
    """A drafter that looks only at each request's token ids (`propose_ids`)."""

    def propose(self, reqs: list[Request]) -> None:
        for req in reqs:
            k = self.max_draft_tokens(req)
            req.draft_ids = self.propose_ids(req.all_ids, k) if k else []

    def propose_ids(self, ids: list[int], k: int | None = None) -> list[int]:
        raise NotImplementedError
