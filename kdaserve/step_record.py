"""`StepRecord`: the KDA step inputs of a verify forward, kept so that the accepted steps can
be replayed through the KDA recurrences alone.

Accepting j < k drafts leaves a request's KDA states k - j steps too far. The state is
restored from its scratch copy and advanced again by the accepted 1 + j steps, which only
needs what each KDA layer fed its fused step (pre-conv q|k|v, gate, beta): those rows depend
on the tokens before them alone (causal), so the verify forward already computed them
exactly, and the replay runs the same fused step token by token (the states come out bit for
bit as the verify's did when it ran that step). The projections, MoE, MLA and LM head are
not run again. (The other option of issue 8, every
intermediate state kept in scratch, needs per-step state output from every kda_chunk backend
and costs H*K*V floats per token per layer to write.)
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class KDASteps(NamedTuple):
    """One KDA layer's inputs for the recorded rows (R of them): what the fused step takes."""

    qkv: torch.Tensor  # [R, 3P] pre-conv q|k|v (the conv runs again on replay)
    f: torch.Tensor  # [R, H, K] raw gate
    beta: torch.Tensor  # [R, H] logits


class StepRecord:
    """Set on a `ForwardBatch` (`record`) to make every KDA layer keep its step inputs for the
    batch rows `rows` (the verifying requests' tokens only: a prefill chunk in the same batch
    is not copied). `layers[i]` belongs to the i-th KDA layer of the model.

    starts: id(req) -> the request's first row in the record."""

    def __init__(self, rows: list[int], starts: dict[int, int],
                 device: torch.device | str) -> None:
        self.rows = torch.tensor(rows, dtype=torch.int64, device=device)
        # how many of the rows are 0, 1, 2, ... (all of them: a verify-only batch)
        self.num_leading = len(rows) if rows == list(range(len(rows))) else -1
        self.starts = starts
        self.layers: list[KDASteps] = []

    def add(self, *tensors: torch.Tensor) -> None:
        """A KDA layer's qkv, f, beta over the whole batch [T, ...] (kept as they
        are when the record is the whole batch: the forward never writes them again)."""
        if tensors[0].shape[0] == self.rows.shape[0] == self.num_leading:
            self.layers.append(KDASteps(*tensors))
            return
        self.layers.append(KDASteps(*(t.index_select(0, self.rows) for t in tensors)))

    def spans(self, replays: list[tuple[int, int]],
              device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(start in the record, steps) per replayed request -> (record rows [T'],
        cu_seqlens [B'+1]) packing those steps."""
        rows, cu = [], [0]
        for start, n in replays:
            rows.extend(range(start, start + n))
            cu.append(cu[-1] + n)
        return (torch.tensor(rows, dtype=torch.int64, device=device),
                torch.tensor(cu, dtype=torch.int64, device=device))
