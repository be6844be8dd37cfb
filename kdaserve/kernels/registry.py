"""Kernel backend registry: each op has backends (`ref`, `cpu`, `native`, `native_wy`,
`batch_invariant`, `triton`) chosen once at build.

A backend registers `(op, name, priority, supports, features)`; `supports(device)` answers
`(ok, reason)`; `features` names the model variants it computes beyond the op's base contract
(say `kda_lower_bound`: K3's gate), so a model that needs one gets a backend that has it.
`resolve` picks the highest-priority supported backend (or the one forced by `KDASERVE_KERNEL`,
`EngineConfig`, or `use_backend` in tests) and returns the plain callable, so layers hold a
function and no dispatch happens inside the forward pass.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

Supports = Callable[[torch.device], tuple[bool, str]]


@dataclass(frozen=True, slots=True)
class Backend:
    op: str
    name: str
    fn: Callable
    priority: int
    supports: Supports
    features: frozenset[str] = frozenset()
    # what the engine may rely on beyond the op's contract, said by the backend itself:
    # GRAPH_SAFE (reads nothing back to the host: capturable in a CUDA graph),
    # FUSED_SHARED_EXPERT (moe_experts takes the shared expert as one more expert),
    # ONE_CALL_DECODE (the native decode forward, decode_step.cpp, makes this op's calls)
    capabilities: frozenset[str] = frozenset()


GRAPH_SAFE, FUSED_SHARED_EXPERT, ONE_CALL_DECODE = "graph_safe", "fused_shared_expert", \
    "one_call_decode"


_BACKENDS: dict[str, list[Backend]] = {}
_forced: list[str] = []  # stack managed by use_backend()


def always(device: torch.device) -> tuple[bool, str]:
    return True, ""


def register(op: str, name: str, fn: Callable, priority: int = 0,
             supports: Supports = always, features: frozenset[str] = frozenset(),
             capabilities: frozenset[str] = frozenset()) -> None:
    _BACKENDS.setdefault(op, []).append(Backend(op, name, fn, priority, supports, features,
                                                capabilities))


def backends(op: str) -> list[Backend]:
    return sorted(_BACKENDS.get(op, []), key=lambda b: -b.priority)


def resolve(op: str, device: torch.device, backend: str | None = None,
            strict: bool = False, features: frozenset[str] = frozenset()) -> Callable:
    """The callable for `op` on `device` (`resolve_backend`'s)."""
    return resolve_backend(op, device, backend, strict, features).fn


def resolve_backend(op: str, device: torch.device, backend: str | None = None,
                    strict: bool = False, features: frozenset[str] = frozenset()) -> Backend:
    """The backend record for `op` on `device`. `backend` (or the override) must be supported;
    `strict`: an op without that backend raises instead of taking the best available.
    `features`: only backends that have all of them (a forced backend without them is
    passed over, or an error when `strict`)."""
    forced = backend or (_forced[-1] if _forced else None) or os.environ.get("KDASERVE_KERNEL")
    candidates = [b for b in backends(op) if features <= b.features]
    if not candidates:
        need = f" with {sorted(features)}" if features else ""
        raise ValueError(f"no kernel registered for op {op!r}{need}")
    if forced:
        for b in candidates:
            if b.name == forced:
                ok, reason = b.supports(device)
                if not ok:
                    raise ValueError(f"kernel backend {forced!r} for {op} unsupported: {reason}")
                return b
        if strict:
            need = f" with {sorted(features)}" if features else ""
            raise ValueError(f"op {op!r} has no {forced!r} kernel{need}")
        # An op without that backend falls back to the best available: a forced "cpu" must
        # not fail just because some op only has the reference implementation.
    for b in candidates:
        if b.supports(device)[0]:
            return b
    raise ValueError(f"no kernel backend for op {op!r} supports device {device}")


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force a backend for models built inside the block (tests compare backends this way)."""
    _forced.append(name)
    try:
        yield
    finally:
        _forced.pop()
