"""Public kernel ops, one function signature per op, resolved once at model build.

Ops (shapes in kernels/ref): `kda_chunk` (prefill), `kda_recurrent` (decode), `short_conv`,
`mla_attention`, `moe_route`, `moe_experts`. Every op has a `ref` backend; faster backends
register with a higher priority. Importing this package never imports triton or CUDA code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from kdaserve.kernels import registry
from kdaserve.kernels.ref.kda import kda_chunk_ref, kda_recurrent_ref, short_conv_ref
from kdaserve.kernels.ref.mla import mla_attention_ref
from kdaserve.kernels.ref.moe import moe_experts_ref, moe_route_ref
from kdaserve.kernels.registry import use_backend


def _cpu_only(device: torch.device) -> tuple[bool, str]:
    return (device.type == "cpu", "" if device.type == "cpu" else "cpu backend needs a CPU")

OPS = ("kda_chunk", "kda_recurrent", "short_conv", "mla_attention", "moe_route", "moe_experts")

registry.register("kda_chunk", "ref", kda_chunk_ref)
registry.register("kda_recurrent", "ref", kda_recurrent_ref)
registry.register("short_conv", "ref", short_conv_ref)
registry.register("mla_attention", "ref", mla_attention_ref)
registry.register("moe_route", "ref", moe_route_ref)
registry.register("moe_experts", "ref", moe_experts_ref)

from kdaserve.kernels.cpu.decode import (  # noqa: E402 - registered after the references
    kda_recurrent_cpu,
    mla_attention_cpu,
    short_conv_cpu,
)

registry.register("kda_recurrent", "cpu", kda_recurrent_cpu, priority=10, supports=_cpu_only)
registry.register("short_conv", "cpu", short_conv_cpu, priority=10, supports=_cpu_only)
registry.register("mla_attention", "cpu", mla_attention_cpu, priority=10, supports=_cpu_only)


class Kernels(NamedTuple):
    kda_chunk: Callable
    kda_recurrent: Callable
    short_conv: Callable
    mla_attention: Callable
    moe_route: Callable
    moe_experts: Callable


def resolve_kernels(device: torch.device, backend: str | None = None) -> Kernels:
    return Kernels(*(registry.resolve(op, device, backend) for op in OPS))


__all__ = ["Kernels", "resolve_kernels", "use_backend", "OPS"]
