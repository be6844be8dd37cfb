"""The tokens of a step in flight (overlap scheduling, engine/overlap.py): a request's output
ends in a placeholder standing for its row of the step's sampled tokens, and the next step's
input ids take the placeholders' values on the device, before the host has read them."""

from __future__ import annotations

import torch


def placeholder(row: int) -> int:
    """The output token standing for row `row` of the step in flight."""
    return -1 - row


def resolve_inputs(input_ids: torch.Tensor, future: torch.Tensor) -> torch.Tensor:
    """input_ids with each placeholder replaced by its row of `future` (the step in flight's
    sampled tokens); device ops only, so nothing waits for that step."""
    picked = future[(-1 - input_ids).clamp(min=0)]
    return torch.where(input_ids < 0, picked, input_ids)
