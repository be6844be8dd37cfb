"""Backends describe themselves (registry.Backend.capabilities): what the engine relies on
beyond an op's contract is read from the chosen backends' records, never from which function
was picked."""

from __future__ import annotations

import torch

from kdaserve.engine.cuda_graph import GRAPHED_OPS
from kdaserve.engine.native_decode import DECODE_OPS
from kdaserve.kernels import resolve_kernels
from kdaserve.kernels.native.build import available
from kdaserve.kernels.registry import FUSED_SHARED_EXPERT, GRAPH_SAFE, ONE_CALL_DECODE

CPU = torch.device("cpu")


def test_the_chosen_backends_capabilities_reach_the_kernels() -> None:
    ref = resolve_kernels(CPU, backend="ref")
    assert ref.capabilities == frozenset() and not ref.fuse_shared_expert
    assert not ref.have(ONE_CALL_DECODE, DECODE_OPS) and not ref.have(GRAPH_SAFE, GRAPHED_OPS)
    assert ref.have(GRAPH_SAFE, ())  # no ops asked: vacuously
    deterministic = resolve_kernels(CPU, deterministic=True)
    assert deterministic.capabilities == frozenset()
    if available()[0]:
        native = resolve_kernels(CPU)
        assert native.have(ONE_CALL_DECODE, DECODE_OPS)
        assert not native.have(GRAPH_SAFE, GRAPHED_OPS)
        assert ("moe_experts", FUSED_SHARED_EXPERT) not in native.capabilities
        # one op from another backend and the one-call decode is off
        mixed = resolve_kernels(CPU)._replace(capabilities=native.capabilities - {
            ("moe_route", ONE_CALL_DECODE)})
        assert not mixed.have(ONE_CALL_DECODE, DECODE_OPS)
