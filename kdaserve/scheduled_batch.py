"""What the scheduler hands the model runner for one step: below the engine, since the
speculative verify (speculative/verify.py) reads it too."""

from __future__ import annotations

from dataclasses import dataclass, field

from kdaserve.request import Request


@dataclass(slots=True)
class ScheduledBatch:
    reqs: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # prefix-cache snapshots inside this step's chunks, (request, position, state slot): the
    # KDA layers write the state after `position` tokens into the slot during the forward
    snapshots: list[tuple[Request, int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.reqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)
