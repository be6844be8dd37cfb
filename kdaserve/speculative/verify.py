"""Verification of drafted tokens with KDA state rollback (greedy acceptance, and lossless
rejection sampling when temperature > 0).

A decode with k drafts runs its last token plus the drafts in one forward (mixed with the
other requests' normal decodes), with logits at all 1 + k positions. Accepting j < k drafts
leaves the KDA recurrent and conv states k - j tokens too far, and a recurrent state cannot be
truncated. Before the forward the request's slot is copied to a scratch slot, and the forward
records every KDA layer's step inputs (`StepRecord`); after it, the state is restored and only
the accepted 1 + j steps are replayed through the KDA conv windows and recurrences (no
projections, MoE, MLA or LM head: a full-model replay cost about as much as the verify). The
rejected tokens' MLA latents need no rollback: the context length simply stops before them and
later tokens overwrite them.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

from kdaserve.cache.radix_cache import RadixCache
from kdaserve.cache.state_pool import StatePool
from kdaserve.kernels import argmax_rows
from kdaserve.request import Request
from kdaserve.sampling_filters import apply_filters
from kdaserve.scheduled_batch import ScheduledBatch
from kdaserve.speculative.acceptance import reject_sample
from kdaserve.speculative.adaptive import AdaptiveSpeculation
from kdaserve.speculative.context_taps import TAPS_OFF_AFTER, TAPS_WARMUP, ContextTaps
from kdaserve.speculative.drafter import Drafter
from kdaserve.speculative.explore import Explorer
from kdaserve.speculative.schedule import StepCost, choose_lengths, plan_drafting
from kdaserve.speculative.survival import SurvivalRecord
from kdaserve.step_record import StepRecord


class Forwarded(Protocol):
    """What a step's forward returns that verification reads (the engine's StepOutput)."""
    @property
    def logits(self) -> torch.Tensor: ...
    @property
    def to_sample(self) -> list[Request]: ...


F = TypeVar("F", bound=Forwarded)

DRAFT_EMA = 0.2  # weight of the newest drafting pass in its typical wall time
# The first drafted step after plain ones is not timed for the fit: it runs cold (the verify
# path's buffers out of cache, new GEMM shapes), and an exploring step timed alone measured
# 50-54 ms at 58 tokens where warm verify steps of 64 took ~31 ms.
# A decision not to draft stands for this many steps while the batch and the typical survival
# stay the same (only the slowly drifting cost fit could change it): planning every step cost
# ~15 us, 3% of a 0.45 ms decode step of k3-tiny, on a path that drafts nothing.
REPLAN_EVERY = 16


@dataclass
class Verified:
    """What a step's logits left after its verifies: the requests sampled as plain decodes and
    their logits rows, each sampled request's kept drafts and the row of its last kept token
    (what its drafter conditions on next), and the requests that took tokens here."""
    plain: list[Request] = field(default_factory=list)
    plain_rows: list[int] = field(default_factory=list)
    accepted: list[tuple[Request, int, int]] = field(default_factory=list)
    took_tokens: list[Request] = field(default_factory=list)
    # for the schedule's cost model: whether the step was decodes and verifies only (a
    # prefill chunk's step is another regime), and whether it verified any draft
    decode_only: bool = False
    drafted: bool = False

    @classmethod
    def nothing_drafted(cls, to_sample: list[Request]) -> Verified:
        return cls(list(to_sample), list(range(len(to_sample))),
                   [(r, 0, i) for i, r in enumerate(to_sample)])


class Speculator:
    """Drives one `Drafter`: proposes before scheduling, saves and restores the target's KDA
    states around verification, accepts drafts, and relays request lifecycle events (the
    scheduler's hooks) to the drafter."""

    def __init__(self, drafter: Drafter, states: StatePool, cache: RadixCache | None,
                 adaptive: AdaptiveSpeculation | None = None,
                 cost: StepCost | None = None) -> None:
        self.drafter, self.states, self.cache = drafter, states, cache
        self.adaptive = adaptive or AdaptiveSpeculation()
        self.cost = cost or StepCost()  # the verify-length schedule's model of a step
        # how often the schedule kept n drafts of a non-empty proposal (benchmarks, tests)
        self.lengths: Counter[int] = Counter()
        self.survival = SurvivalRecord()  # drafts' chances: typical, by position, calibrated
        # the standing decision not to draft: ((running, eligible, decoding,
        # typical_version), steps left)
        self.skip_plan: tuple[tuple[int, int, int, int], int] | None = None
        self.draft_seconds = 0.0  # recent drafting passes' wall time
        self.skipped_in_row = 0
        self.explored_last = False  # the last drafted step was an exploration's
        self.cold = True  # this step drafts after plain ones: not timed for the fit
        self.num_schedule_skips = 0  # steps not drafted: no draft would have paid
        self.num_verifies = 0
        self.num_drafted = 0
        self.num_accepted = 0
        # a context drafter's taps (speculative/context_taps.py)
        self.context = ContextTaps(self.adaptive) \
            if drafter.context_stream is not None else None
        # tries while drafting does not pay (speculative/explore.py); a context drafter's
        # taps come back TAPS_WARMUP steps before
        self.explorer = Explorer(TAPS_WARMUP if self.context is not None else 0)
        self.step_requests, self.step_tapped = 0, False  # the step in flight's
        # a step's time (bench spec's split): "draft" (proposals, context writes), "verify" /
        # "plain" (the forward with / without drafts), "bookkeeping"; and steps of each kind
        self.seconds: Counter[str] = Counter()
        self.steps: Counter[str] = Counter()

    def propose(self, running: list[Request]) -> None:
        """Drafts for decoding requests. Requests with penalties or logprobs decode normally
        (their target distribution at draft i would depend on drafts before i), and so does
        every request the adaptive policy switches off, or all of them in a large batch."""
        eligible = []
        self.drafter.limit = None  # this step's, set below when the schedule plans one
        for req in running:
            req.draft_ids = []
        decoding = sum(not r.is_prefilling for r in running)
        if self._skip_stands(len(running), decoding):
            return
        if not self.adaptive.batch_allows(running):
            return
        for req in running:
            p = req.params
            if req.is_prefilling or p.logprobs is not None or p.repetition_penalty != 1.0 \
                    or p.presence_penalty or p.frequency_penalty:
                continue
            if self.drafter.max_draft_tokens(req) > 0 and self.adaptive.allows(req):
                eligible.append(req)
        if not eligible:
            return
        prefilling = decoding < len(running)
        explore = False
        if not self.survival.typical:  # a first try, of every request (speculative/explore.py)
            if prefilling and self.cost.fitted:
                return  # in a decode step: a prefill chunk's verify is not what is learnt
            if self.cost.fitted:
                self.explorer.first_try()
        else:  # drafting itself costs: draft only what typically pays for it
            planned = self._plan(len(running), len(eligible), decoding)
            if planned:
                self.explorer.stop()
                # one more than typical pays: a request surer than typical may verify it
                self.drafter.limit = planned + 1
            elif self.cost.fitted and not prefilling and self.explorer.due(self.skipped_in_row):
                explore = True
            else:
                self._skip()
                return
        ratio = self.cost.slope_ratio()
        if explore:  # at the prior, so its drafts are verified: one request, in turn
            ratio = 1.0 / self.cost.prior_tokens
            eligible = [eligible[self.explorer.num_started % len(eligible)]]
        self.skipped_in_row = 0
        self.explored_last = explore
        started = time.perf_counter()
        self.drafter.propose(eligible)
        seconds = time.perf_counter() - started
        self.seconds["draft"] += seconds
        self.explorer.spend(seconds)
        self.draft_seconds = seconds if not self.survival.typical else \
            (1 - DRAFT_EMA) * self.draft_seconds + DRAFT_EMA * seconds
        for req in eligible:  # a drafter's contract, enforced: never past max_tokens
            del req.draft_ids[self.drafter.max_draft_tokens(req):]
        survival = [self.survival.estimate(len(req.draft_ids), self.drafter.survival(req))
                    for req in eligible]
        self.survival.observe(survival)
        for req, n in zip(eligible, choose_lengths(survival, ratio, decoding), strict=True):
            if req.draft_ids:
                # an exploration verifies one draft at least: what it is for is an outcome
                # (a drafter whose record says its drafts miss would otherwise draft, verify
                # nothing and never learn that the text changed)
                n = max(n, 1) if explore else n
                del req.draft_ids[n:]
                self.lengths[n] += 1

    def _skip_stands(self, running: int, decoding: int) -> bool:
        """Whether a decision not to draft still stands for this batch, with no exploration
        due: then this step is skipped without looking at each request."""
        plan = self.skip_plan
        if plan is None or plan[1] <= 0 or plan[0][0] != running or plan[0][2] != decoding \
                or plan[0][3] != self.survival.typical_version or self.explorer.may_start(
                    self.skipped_in_row + 1):
            return False
        self.skip_plan = (plan[0], plan[1] - 1)
        self._skip()
        return True

    def _skip(self) -> None:
        """This step drafts nothing: no draft would pay."""
        self.skipped_in_row += 1
        self.num_schedule_skips += 1
        self.cold = True

    def _plan(self, running: int, eligible: int, decoding: int) -> int:
        """Drafts per request worth drafting this step (`plan_drafting`); a decision not to
        draft stands REPLAN_EVERY steps for the same batch and typical survival."""
        key = (running, eligible, decoding, self.survival.typical_version)
        fit = self.cost.fit()
        ratio = self.cost.slope_ratio()
        # a context drafter's context writes are a cost of drafting too
        spent = self.draft_seconds + (self.context.seconds if self.context else 0.0)
        draft_cost = spent / fit[0] if fit is not None and fit[0] > 0 else 0.0
        planned = plan_drafting(self.survival.typical, eligible, ratio, decoding, draft_cost)
        self.skip_plan = None if planned else (key, REPLAN_EVERY)
        return planned

    def observe_step(self, tokens: int, seconds: float, drafted: bool) -> None:
        """A decode/verify step's size and wall time (drafting not included), for the
        schedule's cost model (the first drafted step after plain ones is left out: cold)
        and the explorations' budget."""
        self.explorer.observe(self.step_requests, seconds, drafted, self.step_tapped)
        if drafted and self.cold:
            self.cold = False
            return
        self.cost.observe(tokens, seconds)

    def drafting_soon(self) -> bool:
        """Whether a request may draft within TAPS_WARMUP steps (a context drafter's taps
        are taken until then): before the first try, within TAPS_OFF_AFTER steps of a
        drafted step the schedule planned, or while an exploration warms up or runs (not
        after it: its drafts did not pay, and each tapped step leaves the one-call decode
        path, on k3-tiny ten times a plain step)."""
        return not self.survival.typical or self.explorer.active \
            or (self.skipped_in_row < TAPS_OFF_AFTER and not self.explored_last)

    # ---- lifecycle: the scheduler's hooks, relayed (tests swap the drafter) ----
    def on_admit(self, req: Request) -> None:
        self.drafter.on_admit(req)

    def on_release(self, req: Request) -> None:
        self.drafter.on_release(req)

    def on_finish(self, req: Request) -> None:
        self.adaptive.forget(req)
        self.drafter.on_finish(req)

    def on_abort(self, req: Request) -> None:
        self.adaptive.forget(req)
        self.drafter.on_abort(req)

    def on_preempt(self, req: Request) -> None:
        self.drafter.on_preempt(req)

    def release_memory(self, tag: str) -> None:  # RL's release and resume of memory
        self.drafter.release_memory(tag)

    def resume_memory(self, tag: str) -> None:
        self.drafter.resume_memory(tag)

    def save(self, batch: ScheduledBatch) -> dict[int, tuple[int, int]]:
        """Scratch copies of the verifying requests' states: id(req) -> (scratch, start)."""
        saved = {}
        pairs = []
        for i, req in enumerate(batch.reqs):
            if not req.draft_ids:
                continue
            if self.states.num_free == 0 and not (self.cache and self.cache.evict_snapshots(1)):
                req.draft_ids = []  # no room to roll back: decode normally this step
                batch.num_new_tokens[i] = 1
                continue
            scratch = self.states.allocate(zero=False)
            assert req.state_slot is not None
            pairs.append((req.state_slot, scratch))
            saved[id(req)] = (scratch, req.num_computed_tokens)
        self.states.copy_many(pairs)
        return saved

    def record(self, batch: ScheduledBatch, saved: dict[int, tuple[int, int]],
               device: torch.device) -> StepRecord:
        """What the verify forward keeps for the rollback: the saved requests' rows."""
        rows: list[int] = []
        starts: dict[int, int] = {}
        row = 0
        for req, n in zip(batch.reqs, batch.num_new_tokens, strict=True):
            if id(req) in saved:
                starts[id(req)] = len(rows)
                rows.extend(range(row, row + n))
            row += n
        return StepRecord(rows, starts, device)

    def accept(self, req: Request, rows: torch.Tensor, start: int,
               argmax: list[int] | None = None) -> tuple[list[int], bool]:
        """Greedy acceptance: drafts are kept while they equal the target's argmax; the
        target's token at the first mismatch (or after the last draft) is the bonus. Returns
        the new tokens and whether states must be rolled back. argmax: the rows' argmax when
        the caller took it for the whole batch at once (one op, not one per request)."""
        own = self.drafter.survival(req)  # this step's estimate, for the calibration
        drafts, req.draft_ids = req.draft_ids, []
        if req.params.is_greedy:
            targets = rows.argmax(-1).tolist() if argmax is None else argmax
            j = 0
            while j < len(drafts) and drafts[j] == targets[j]:
                j += 1
            bonus = targets[j]
        else:
            probs = apply_filters(rows.float(), [req] * rows.shape[0])
            j, bonus = reject_sample(probs, drafts, req.generator)
        req.num_computed_tokens = start + 1 + j
        req.num_drafted += len(drafts)
        req.num_accepted += j
        req.num_verifies += 1
        self.num_verifies += 1
        self.num_drafted += len(drafts)
        self.num_accepted += j
        self.adaptive.record(req, len(drafts), j)
        self.survival.verified(len(drafts), j, own)
        return drafts[:j] + [bonus], j < len(drafts)

    def verify(self, to_sample: list[Request], logits: torch.Tensor,
               saved: dict[int, tuple[int, int]], take: Callable[[Request, int], None],
               mask: Callable[[Request, torch.Tensor], torch.Tensor],
               replay: Callable[[list[tuple[Request, int]]], None]) -> Verified:
        """Accepts each drafted request's tokens from its 1 + k logits rows (rows in
        `to_sample` order; a request not in `saved` drafted nothing and has one row), hands
        them to `take` until the request finishes, and rolls the KDA states of those that
        rejected drafts back to the accepted steps: restored from their scratch slots, then
        `replay`ed (the verify forward's recorded steps). `mask`: a grammar-constrained
        request's rows, each position masked by the grammar's state after its drafts."""
        out = Verified()
        row = 0
        argmax: list[int] | None = None  # every row's, taken once for greedy verifies
        restores: list[tuple[Request, int]] = []  # (req, its saved states' slot)
        steps: list[tuple[Request, int]] = []  # (req, accepted steps to replay)
        for req in to_sample:
            if id(req) not in saved:
                out.plain.append(req)
                out.plain_rows.append(row)
                out.accepted.append((req, 0, row))
                row += 1
                continue
            k = len(req.draft_ids)
            scratch, start = saved[id(req)]
            rows = logits[row:row + 1 + k]
            unmasked = None
            if req.matcher is None and req.params.is_greedy:
                if argmax is None:
                    argmax = argmax_rows(logits).tolist()
                unmasked = argmax[row:row + 1 + k]
            if req.matcher is not None:
                rows = mask(req, rows)
            tokens, rollback = self.accept(req, rows, start, unmasked)
            out.accepted.append((req, len(tokens) - 1, row + len(tokens) - 1))
            row += 1 + k
            for t in tokens:
                take(req, t)
                if req.is_finished:
                    break
            out.took_tokens.append(req)
            if rollback and not req.is_finished:
                restores.append((req, scratch))
                steps.append((req, req.num_computed_tokens - start))
        if steps:
            self.restore(restores)
            replay(steps)  # the accepted KDA steps only
        return out

    def step(self, batch: ScheduledBatch, device: torch.device,
             forward: Callable[[tuple[int, ...] | None, StepRecord | None], F],
             take: Callable[[Request, int], None],
             mask: Callable[[Request, torch.Tensor], torch.Tensor],
             replay: Callable[[StepRecord, list[tuple[Request, int]]], None],
             ) -> tuple[F, Verified]:
        """A step with drafts: the verifying requests' states saved, the forward (asked for
        the drafter's hidden rows, recording the KDA steps for a rollback), the drafts
        verified, the scratch slots freed whatever happens."""
        taps: tuple[int, ...] | None = self.drafter.taps if self.drafter.wants_hidden else None
        self.step_requests, self.step_tapped = len(batch.reqs), False
        if self.context is not None:
            if self.context.tapping(batch, self.drafting_soon()):
                self.context.start(batch)
                self.step_tapped = True
            else:
                taps = None
        if not any(r.draft_ids for r in batch.reqs):
            # a plain step (the schedule's usual answer when drafting does not pay): nothing
            # to save, record or verify (a drafter's rows are still asked for)
            before = time.perf_counter()
            out = forward(taps, None)
            self.seconds["plain"] += time.perf_counter() - before
            self.steps["plain"] += 1
            verified = Verified.nothing_drafted(out.to_sample)
            verified.decode_only = batch.num_tokens == len(batch.reqs)
            return out, verified
        decode_only = all(n == 1 + len(r.draft_ids)
                          for r, n in zip(batch.reqs, batch.num_new_tokens, strict=True))
        started = time.perf_counter()
        saved = self.save(batch)
        try:
            record = self.record(batch, saved, device) if saved else None
            before = time.perf_counter()
            out = forward(taps, record)
            after = time.perf_counter()
            if record is None:
                verified = Verified.nothing_drafted(out.to_sample)
            else:
                verified = self.verify(out.to_sample, out.logits, saved, take, mask,
                                       lambda steps: replay(record, steps))
        finally:
            self.release(saved)
        kind = "verify" if saved else "plain"
        self.seconds[kind] += after - before
        self.steps[kind] += 1
        self.seconds["bookkeeping"] += time.perf_counter() - started - (after - before)
        verified.decode_only, verified.drafted = decode_only, bool(saved)
        return out, verified

    def after_step(self, verified: Verified, hidden: torch.Tensor | None, tokens: int,
                   seconds: float) -> None:
        """The step's tokens are sampled: each drafter follows what its request kept, and
        the schedule's cost model sees the step's size and time."""
        if self.context is not None:  # the drafter's context: a cost of drafting
            seconds_context = self.context.hand_over(self.drafter, hidden)
            self.seconds["draft"] += seconds_context
            self.explorer.spend(seconds_context)
            hidden = None  # not the sampling rows: on_accept gets none
        started = time.perf_counter()
        for req, j, r in verified.accepted:
            if not req.is_finished:
                self.drafter.on_accept(req, j, hidden[r] if hidden is not None else None)
        self.seconds["bookkeeping"] += time.perf_counter() - started
        if verified.decode_only:
            self.observe_step(tokens, seconds, verified.drafted)

    def restore(self, restores: list[tuple[Request, int]]) -> None:
        """Back to the KDA states before the verify forward, ready to replay the accepted
        steps (req.num_computed_tokens already counts them): (req, its scratch slot)."""
        pairs = []
        for req, scratch in restores:
            assert req.state_slot is not None
            pairs.append((scratch, req.state_slot))
        self.states.copy_many(pairs)

    def release(self, saved: dict[int, tuple[int, int]]) -> None:
        for scratch, _ in saved.values():
            self.states.free(scratch)

    def metrics(self) -> dict[str, float]:
        return {"spec_num_verifies": self.num_verifies, "spec_num_drafted": self.num_drafted,
                "spec_num_accepted": self.num_accepted,
                "spec_num_switched_off": self.adaptive.num_switched_off,
                "spec_num_batch_skips": self.adaptive.num_batch_skips,
                "spec_num_schedule_skips": self.num_schedule_skips,
                "spec_num_explorations": self.explorer.num_explorations,
                "spec_mean_acceptance_length": (self.num_accepted + self.num_verifies)
                / self.num_verifies if self.num_verifies else 0.0,
                **{f"spec_seconds_{k}": self.seconds[k]
                   for k in ("draft", "verify", "plain", "bookkeeping")},
                "spec_steps_verify": self.steps["verify"], "spec_steps_plain": self.steps["plain"]}
