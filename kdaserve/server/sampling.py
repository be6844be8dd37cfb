"""Every endpoint's one way to `SamplingParams`.

A request model gives its sampling fields by the engine's names, None where the request omits
one (`SamplingFields.sampling_fields`, `GenerateSampling.sampling_fields`). The server's
sampling policy fills its defaults and refuses what it does not allow, for the request's mode
(chat: the template's thinking switch; a raw prompt, completions or /generate: the chat
format's default mode). What is still omitted takes `SamplingParams`' own defaults, and
`SamplingParams` checks every range (an error names the field). An endpoint decides only what
is its own: max_tokens, logprobs, and what its format adds (a grammar, stop markers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kdaserve.request import SamplingParams
from kdaserve.server.sampling_policy import SamplingPolicy


@dataclass(frozen=True)
class Sampling:
    policy: SamplingPolicy | None = None
    default_thinking: bool = False  # a raw prompt's mode

    def params(self, fields: dict[str, Any], thinking: bool | None = None,
               **decided: Any) -> SamplingParams:
        """`fields`: the request's (None = omitted); `decided`: the endpoint's own."""
        mode = self.default_thinking if thinking is None else thinking
        values = self.policy.apply(fields, mode) if self.policy is not None else fields
        return SamplingParams(**{k: v for k, v in values.items() if v is not None}, **decided)
