"""Every registered backend of an op takes the op's signature (kernels/interface.py): the same
parameters, in the same order, optional where the Protocol's are, and nothing more that a
caller would have to pass. A parameter that belongs to a feature (K3's `lower_bound`, SiTU's
`situ`) may be missing from a backend that does not declare that feature: the registry never
picks it for a model that needs it."""

from __future__ import annotations

import inspect
import typing

import pytest

from kdaserve.kernels import OPS, VISION_OPS, Kernels, VisionKernels, registry

FEATURE_PARAMS = {"lower_bound": "kda_lower_bound", "situ": "situ"}
# the text model's ops, and the vision tower's
HINTS = {**typing.get_type_hints(Kernels), **typing.get_type_hints(VisionKernels)}


def params(fn: object) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def mismatches(op: str, fn: object, features: frozenset[str]) -> list[str]:
    """How `fn` departs from `op`'s Protocol (empty: it takes every call the op takes)."""
    want = params(HINTS[op].__call__)
    have = {p.name: (i, p) for i, p in enumerate(params(fn))}
    found = []
    position = 0
    for p in want:
        if p.name not in have:
            feature = FEATURE_PARAMS.get(p.name)
            if feature is None or feature in features:
                found.append(f"no parameter {p.name}")
            continue
        i, q = have[p.name]
        if p.kind is not p.KEYWORD_ONLY:
            if i != position:
                found.append(f"{p.name} at position {i}, not {position}")
            position = i + 1
        if p.default is not p.empty and q.default is q.empty:
            found.append(f"{p.name} must be optional")
    names = {p.name for p in want}
    found += [f"{q.name} is not the op's and has no default" for n, (_, q) in have.items()
              if n not in names and q.default is q.empty and q.kind is not q.VAR_KEYWORD]
    return found


@pytest.mark.parametrize("op", [*OPS, *VISION_OPS])
def test_every_backend_takes_the_ops_signature(op: str) -> None:
    found = registry.backends(op)
    assert found, f"{op}: no backend"
    for backend in found:
        assert not mismatches(op, backend.fn, backend.features), \
            (backend.name, backend.fn.__qualname__, mismatches(op, backend.fn, backend.features))


def test_the_check_sees_a_departure() -> None:
    def swapped(x, scale, weight):  # noqa: ANN001, ANN202
        return x

    def needs_more(x, weight, scale=None, bias=0, *, mode):  # noqa: ANN001, ANN202
        return x

    def no_situ(x, weights, ids, w13, w2, scale13=None, scale2=None):  # noqa: ANN001, ANN202
        return x

    assert mismatches("linear", swapped, frozenset()) == [
        "weight at position 2, not 1", "scale at position 1, not 3", "scale must be optional"]
    assert mismatches("linear", needs_more, frozenset()) == [
        "mode is not the op's and has no default"]
    assert mismatches("moe_experts", no_situ, frozenset()) == []  # SiTU not declared
    assert mismatches("moe_experts", no_situ, frozenset({"situ"})) == ["no parameter situ"]
