"""mlx-lm's `kimi_k3` (mlx[cpu]) as the K3 oracle: loading a checkpoint directory as it is,
logits, final hidden states, cached greedy decoding and the router's choices. Imported by
the K3 tests only after `pytest.importorskip("mlx.core")`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import torch
from mlx_lm.models import kimi_k3
from mlx_lm.utils import load_model


def load(path: Path) -> Any:
    return load_model(path)[0]


def _torch(a: mx.array) -> torch.Tensor:
    return torch.tensor(a.astype(mx.float32).tolist())


def logits(model: Any, ids: list[int]) -> torch.Tensor:
    return _torch(model(mx.array([ids]))[0])


def hidden(model: Any, ids: list[int]) -> torch.Tensor:
    """The final-normed hidden states [T, D] (what the LM head sees)."""
    return _torch(model.model(mx.array([ids]))[0])


def greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    cache = model.make_cache()
    out_logits = model(mx.array([prompt]), cache=cache)
    out: list[int] = []
    for _ in range(n):
        out.append(int(mx.argmax(out_logits[0, -1]).item()))
        out_logits = model(mx.array([[out[-1]]]), cache=cache)
    return out


def routing(model: Any, ids: list[int]) -> torch.Tensor:
    """[T, MoE layers, k] the experts mlx-lm's router picks in one forward, taken from its
    expert-selection function while the forward runs."""
    got: list[mx.array] = []
    select = kimi_k3._group_expert_select

    def recording(*args: Any) -> tuple[mx.array, mx.array]:
        inds, weights = select(*args)
        got.append(inds)
        return inds, weights

    kimi_k3._group_expert_select = recording
    try:
        mx.eval(model(mx.array([ids])))
    finally:
        kimi_k3._group_expert_select = select
    return torch.stack([torch.tensor(g[0].tolist(), dtype=torch.int32) for g in got], 1)
