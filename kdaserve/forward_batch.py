"""`ForwardBatch`: everything one model forward needs, passed explicitly to every layer.

A batch packs the new tokens of B sequences (prefill chunks and decodes alike) into one flat
[T] stream; `cu_seqlens` marks the sequences. Layers read their caches through `state_slots`
(KDA) and `block_table` / `slot_mapping` (MLA); nothing is global.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from kdaserve.kernels.host_memory import to_device

if TYPE_CHECKING:
    from kdaserve.step_record import StepRecord


METADATA = ("input_ids", "positions", "cu_seqlens", "context_lens", "state_slots",
            "block_table", "slot_mapping", "logits_indices")


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each token in its sequence
    cu_seqlens: torch.Tensor  # [B+1] int64, new tokens per sequence
    context_lens: torch.Tensor  # [B] int64, cached + new tokens after this step
    state_slots: torch.Tensor  # [B] int64, KDA state pool slot per sequence
    block_table: torch.Tensor  # [B, M] int64, MLA cache blocks per sequence
    slot_mapping: torch.Tensor  # [T] int64, flat cache row (block * block_size + offset)
    logits_indices: torch.Tensor  # [L] int64, rows of [T] whose logits are wanted
    is_decode: bool = False  # every sequence has exactly one new token
    max_seqlen: int = 0  # the most new tokens of any sequence (0: not known)
    # set for a verify forward: KDA layers keep their step inputs for the state rollback
    record: StepRecord | None = None
    # prefix-cache snapshots inside this step's chunks: (sequence index [S], tokens of that
    # sequence's chunk up to and including the snapshot position [S], state pool slot [S])
    snapshots: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # rollout routing replay: when a list, each MoE layer appends its chosen experts [T, k]
    routing: list[torch.Tensor] | None = None
    # a DSpark drafter's tap layers: the forward keeps the residual stream after each of them
    # at the logits rows, concatenated, in `tapped` [L, len(taps) * D]; at every row with
    # `tap_all_rows` (a drafter that keeps the context's taps: [T, len(taps) * D]). K3's
    # `tap_stream`: "partial", the block's partial sum after the layer, or "aggregated", the
    # mix the next layer's attention-side AttnRes forms from it (the output-side one after
    # the last layer), before its norm; one residual stream in a model without AttnRes
    taps: tuple[int, ...] = ()
    # rows of the input embeddings replaced before the first layer: (flat rows [R], their
    # values [R, D]): images' projected rows at their pads (multimodal.py)
    embed_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    tap_all_rows: bool = False
    tap_stream: str = "partial"
    tapped: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def owning(self) -> ForwardBatch:
        """A copy whose metadata tensors own just their elements: `build`'s are views of one
        buffer, and pickling a view writes the whole buffer (the tensor-parallel broadcast
        would carry it eight times)."""
        return replace(self, **{name: getattr(self, name).clone() for name in METADATA})

    @classmethod
    def build(cls, new_tokens: list[list[int]], num_cached: list[int], state_slots: list[int],
              block_tables: list[list[int]], block_size: int, all_logits: bool = False,
              sample: list[bool] | None = None, num_logits: list[int] | None = None,
              logits_from: list[int] | None = None,
              device: torch.device | str = "cpu") -> ForwardBatch:
        """Pack per-sequence metadata (host lists) into tensors.

        new_tokens[b]: token ids to run now; num_cached[b]: tokens of that sequence already in
        the caches; block_tables[b] must cover num_cached[b] + len(new_tokens[b]) tokens.
        Logits are computed for the last num_logits[b] (default 1) tokens of each sequence
        with sample[b] (default: all; speculative verification wants several), for every
        token with all_logits, or, given logits_from, for the tokens from logits_from[b] on
        (the sequence's length: none).
        """
        ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        cu = [0]
        logits_rows: list[int] = []
        if sample is None:
            sample = [True] * len(new_tokens)
        if num_logits is None:
            num_logits = [1] * len(new_tokens)
        if logits_from is None:
            logits_from = [len(t) - m if wanted else len(t)
                           for t, wanted, m in zip(new_tokens, sample, num_logits, strict=True)]
        if all_logits:
            logits_from = [0] * len(new_tokens)
        for toks, start, table, first in zip(new_tokens, num_cached, block_tables, logits_from,
                                             strict=True):
            if not toks:
                raise ValueError("every sequence in a batch needs at least one new token")
            n = len(toks)
            if len(table) * block_size < start + n:
                raise ValueError("block table too short for the sequence")
            if n == 1:  # a decode: the general case's ranges cost ~2x on a step's host time
                ids.append(toks[0])
                positions.append(start)
                slot_mapping.append(table[start // block_size] * block_size
                                    + start % block_size)
                if first == 0:
                    logits_rows.append(cu[-1])
                else:
                    logits_rows.extend(range(cu[-1] + first, cu[-1] + 1))
                cu.append(cu[-1] + 1)
                continue
            ids.extend(toks)
            pos = range(start, start + n)
            positions.extend(pos)
            slot_mapping.extend(table[p // block_size] * block_size + p % block_size for p in pos)
            logits_rows.extend(range(cu[-1] + first, cu[-1] + n))
            cu.append(cu[-1] + n)
        # one host tensor for every field (the block table padded in Python), split into
        # views: a tensor per field costs ~8 us on a CPU, and on a GPU each would be its own
        # copy; here there is one, queued without waiting for the step in flight
        width = max(len(t) for t in block_tables)
        context = [s + len(n) for s, n in zip(num_cached, new_tokens, strict=False)]
        fields = (ids, positions, cu, context, list(state_slots), slot_mapping, logits_rows)
        flat = [v for f in fields for v in f]
        for t in block_tables:
            flat.extend(t)
            flat.extend([0] * (width - len(t)))
        parts = to_device(torch.tensor(flat, dtype=torch.int64), device).split(
            [len(f) for f in fields] + [len(block_tables) * width])
        return cls(
            input_ids=parts[0],
            positions=parts[1],
            cu_seqlens=parts[2],
            context_lens=parts[3],
            state_slots=parts[4],
            block_table=parts[7].view(len(block_tables), width),
            slot_mapping=parts[5],
            logits_indices=parts[6],
            is_decode=all(len(x) == 1 for x in new_tokens),
            max_seqlen=max(len(x) for x in new_tokens),
        )
