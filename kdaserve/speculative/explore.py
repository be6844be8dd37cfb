"""When a schedule that has stopped drafting tries again, with whom, and what trying may cost.

A schedule that has stopped drafting (no draft would pay: `plan_drafting`) still tries now and
then: acceptance changes with the text, and a fit misled by a few slow verifies would
otherwise never see another verify step to correct it. Trying is not free: drafting passes,
longer verify steps and, for a context drafter, the taps it needs first (TAPS_WARMUP plain
steps off the one-call decode path). So:
- one request explores, not the batch (each exploration the next one, for all its steps): its
  drafts' survival is what the schedule learns from, and the other requests' contexts stay
  unprojected (on k3-bench a batch of 16 whose exploration drafted for all of them spent 2 s
  projecting their prompts, in a run whose decode took 2.7 s);
- an exploration is budgeted: the next one starts only when the plain decode time since the
  last is 1 / EXPLORE_SHARE times what the last cost beyond plain decoding (its drafting
  passes and context writes, its steps' time beyond a plain step of the same batch size (or
  the nearest seen), its warm-up steps' likewise), so exploring costs about EXPLORE_SHARE of
  the decode time, whatever the drafter, the machine and the batch (the last exploration's
  cost stands for the next one's);
- and it waits for EXPLORE_AFTER skipped steps in a row at least.
The first try (before any proposal has drafts) drafts for every eligible request, once per
engine: the first `typical` survival comes from the whole batch, and its cost, times
EXPLORE_STEPS (a whole exploration's steps), sets the budget of the first exploration.
"""

from __future__ import annotations

EXPLORE_AFTER = 32
EXPLORE_STEPS = 4
EXPLORE_SHARE = 0.02
PLAIN_EMA = 0.1  # weight of the newest plain decode step in its typical time, per batch size

IDLE, WARMING, EXPLORING = "idle", "warming", "exploring"


class Explorer:
    def __init__(self, warmup_steps: int = 0) -> None:
        self.warmup_steps = warmup_steps  # plain steps an exploration's taps need first
        self.phase, self.left = IDLE, 0
        self.plain_seconds = 0.0  # untapped plain decode time since the last exploration
        self.cost = 0.0  # the last exploration's seconds beyond plain decoding
        self.spent = 0.0  # the current one's so far
        self.plain_step: dict[int, float] = {}  # a plain untapped decode step, by batch size
        self.num_explorations = 0  # exploring steps (metrics)
        self.num_started = 0  # explorations begun: which request explores (one each)

    @property
    def active(self) -> bool:
        return self.phase != IDLE

    def first_try(self) -> None:
        """Before any proposal has drafts: this step explores, and is the whole exploration
        (the next decode step observed closes it)."""
        self.phase, self.left, self.spent = EXPLORING, 0, 0.0
        self.num_explorations += 1

    def may_start(self, skipped_in_row: int) -> bool:
        """Whether `due` could start or continue an exploration now."""
        return self.phase != IDLE or (skipped_in_row >= EXPLORE_AFTER
                                      and self.plain_seconds * EXPLORE_SHARE >= self.cost)

    def due(self, skipped_in_row: int) -> bool:
        """Asked on each decode step the schedule would not draft: whether this one explores
        (an exploration's warm-up steps do not; its EXPLORE_STEPS after them do)."""
        if self.phase == IDLE and self.may_start(skipped_in_row):
            self.phase, self.left, self.spent = WARMING, self.warmup_steps, 0.0
        if self.phase == WARMING:
            if self.left > 0:
                self.left -= 1
                return False
            self.phase, self.left = EXPLORING, EXPLORE_STEPS
            self.num_started += 1
        if self.phase == EXPLORING and self.left > 0:
            self.left -= 1
            self.num_explorations += 1
            return True
        return False

    def stop(self) -> None:
        """Drafting pays again: whatever exploration was under way is over."""
        self.phase, self.left, self.plain_seconds = IDLE, 0, 0.0

    def spend(self, seconds: float) -> None:
        """Drafting passes and context writes: an exploration's cost while one is on."""
        if self.active:
            self.spent += seconds

    def observe(self, requests: int, seconds: float, drafted: bool, tapped: bool) -> None:
        """A decode step's forward time, `requests` decoding."""
        if not (drafted or tapped):
            base = self.plain_step.get(requests)
            self.plain_step[requests] = seconds if base is None else \
                (1 - PLAIN_EMA) * base + PLAIN_EMA * seconds
            if not self.active:
                self.plain_seconds += seconds
        elif self.active and self.plain_step:
            # beyond a plain step of this batch size, else of the nearest seen (load moves)
            near = min(self.plain_step, key=lambda n: abs(n - requests))
            self.spent += max(seconds - self.plain_step[near], 0.0)
        if self.phase == EXPLORING and self.left == 0:  # its last step is in
            # the first try is one step: a whole exploration is EXPLORE_STEPS of them (a
            # short run would otherwise pay for its first exploration at a one-step budget)
            scale = EXPLORE_STEPS if self.num_started == 0 else 1
            self.cost, self.phase, self.plain_seconds = scale * self.spent, IDLE, 0.0
