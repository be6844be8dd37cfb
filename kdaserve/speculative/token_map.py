"""Hot-token maps (FR-Spec, as in EAGLE-3 and SGLang's `--speculative-token-map`): a block or
DSpark drafter's output head cut to the tokens its target emits most often.

A drafted block's cost at batch 16 is mostly its vocabulary: the head's [H, V] product for
every drafted position, and DSpark's Markov head ([r, V] per position). The target's text
rarely leaves a few thousand tokens, so cutting the head to the N most frequent costs a draft
only when the target's token is outside them (it would be rejected anyway: verification stays
the target's and lossless) and divides the head's work by V / N.

The map is a file of distinct token ids, most frequent first: `.pt` (a 1-D integer tensor,
SGLang's format) or `.json` (a list). `kdaserve token-map` writes one from GSM8K text.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn


def load_token_map(path: str | Path, vocab_size: int) -> torch.Tensor:
    """The token ids of a map file (int64 [N]), checked against the target's vocabulary."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"speculative_token_map {p}: no such file")
    if p.suffix == ".json":
        try:
            raw = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_token_map {p}: not JSON ({e})") from e
        if not isinstance(raw, list) or not all(type(t) is int for t in raw):
            raise ValueError(f"speculative_token_map {p}: need a JSON list of token ids")
        ids = torch.tensor(raw, dtype=torch.int64)
    elif p.suffix == ".pt":
        try:
            ids = torch.load(p, weights_only=True)
        except Exception as e:  # noqa: BLE001  (torch raises many kinds on a bad file)
            raise ValueError(f"speculative_token_map {p}: not a torch tensor file ({e})") from e
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point() \
                or ids.is_complex():
            raise ValueError(f"speculative_token_map {p}: need a 1-D integer tensor")
        ids = ids.to(torch.int64)
    else:
        raise ValueError(f"speculative_token_map {p}: need a .pt or .json file")
    if ids.numel() == 0:
        raise ValueError(f"speculative_token_map {p} is empty")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"speculative_token_map {p}: token ids must be in [0, {vocab_size})")
    if ids.unique().numel() != ids.numel():
        raise ValueError(f"speculative_token_map {p}: token ids repeat")
    return ids


def hot_tokens(sequences: Iterable[list[int]], n: int) -> tuple[list[int], float]:
    """The n most frequent tokens of the sequences (ties: the lower id first) and the share
    of all token occurrences they cover."""
    counts: Counter[int] = Counter()
    for seq in sequences:
        counts.update(seq)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
    total = sum(counts.values())
    return [t for t, _ in ranked], sum(c for _, c in ranked) / max(total, 1)


def save_token_map(ids: list[int], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.suffix == ".json":
        p.write_text(json.dumps(ids))
    elif p.suffix == ".pt":
        torch.save(torch.tensor(ids, dtype=torch.int64), p)
    else:
        raise ValueError(f"token map {p}: need a .pt or .json file name")
    return p


def cut_rows(head: nn.Linear, ids: torch.Tensor) -> None:
    """An output head keeps only the rows of `ids` (its logits then index into ids)."""
    head.weight = nn.Parameter(head.weight.data[ids], requires_grad=False)
