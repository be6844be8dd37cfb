"""Public kernel ops, one function signature per op, resolved once at model build.

Ops (shapes in kernels/ref): `linear` (every projection), `kda_chunk` (prefill),
`kda_recurrent` (token by token: the oracle of the chunk form), `kda_decode` (a whole KDA
decode step, conv to gated norm), `short_conv`, `mla_attention`, `moe_route`, `moe_experts`.
Every op has a `ref` backend (plain torch, the oracle); `cpu` is batched torch for decode
shapes; `native` is C++ compiled for the host on first use; `triton` runs fla-core's Triton
KDA kernels on CUDA. Importing this package never imports triton or CUDA code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kdaserve.kernels import registry
from kdaserve.kernels.ref.kda import (
    kda_chunk_ref,
    kda_decode_ref,
    kda_recurrent_ref,
    short_conv_ref,
)
from kdaserve.kernels.ref.mla import mla_attention_ref
from kdaserve.kernels.ref.moe import moe_experts_ref, moe_route_ref
from kdaserve.kernels.registry import use_backend


def _cpu_only(device: torch.device) -> tuple[bool, str]:
    return (device.type == "cpu", "" if device.type == "cpu" else "cpu backend needs a CPU")

def linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T without bias: every projection of the model."""
    return F.linear(x, weight)


OPS = ("linear", "kda_chunk", "kda_recurrent", "kda_decode", "short_conv", "mla_attention",
       "moe_route", "moe_experts")

registry.register("linear", "ref", linear_ref)
registry.register("kda_chunk", "ref", kda_chunk_ref)
registry.register("kda_recurrent", "ref", kda_recurrent_ref)
registry.register("kda_decode", "ref", kda_decode_ref)
registry.register("short_conv", "ref", short_conv_ref)
registry.register("mla_attention", "ref", mla_attention_ref)
registry.register("moe_route", "ref", moe_route_ref)
registry.register("moe_experts", "ref", moe_experts_ref)

from kdaserve.kernels.cpu.decode import (  # noqa: E402 - registered after the references
    kda_decode_cpu,
    kda_recurrent_cpu,
    mla_attention_cpu,
    short_conv_cpu,
)
from kdaserve.kernels.cpu.moe import moe_experts_cpu  # noqa: E402
from kdaserve.kernels.native import build as native_build  # noqa: E402
from kdaserve.kernels.native.ops import (  # noqa: E402
    kda_chunk_native,
    kda_chunk_native_wy,
    kda_decode_native,
    linear_native,
    mla_attention_native,
    moe_experts_native,
)
from kdaserve.kernels.triton import supports as _triton  # noqa: E402
from kdaserve.kernels.triton.kda import kda_chunk_triton, kda_decode_triton  # noqa: E402


def _native(device: torch.device) -> tuple[bool, str]:
    # Compiling happens here, once, when the first model is built on a CPU.
    return native_build.available() if device.type == "cpu" else (False, "needs a CPU")


registry.register("kda_recurrent", "cpu", kda_recurrent_cpu, priority=10, supports=_cpu_only)
registry.register("kda_decode", "cpu", kda_decode_cpu, priority=10, supports=_cpu_only)
registry.register("kda_decode", "native", kda_decode_native, priority=20, supports=_native)
registry.register("kda_chunk", "native", kda_chunk_native, priority=20, supports=_native)
registry.register("kda_chunk", "native_wy", kda_chunk_native_wy, priority=15, supports=_native)
registry.register("mla_attention", "native", mla_attention_native, priority=20,
                  supports=_native)
registry.register("moe_experts", "cpu", moe_experts_cpu, priority=10, supports=_cpu_only)
registry.register("moe_experts", "native", moe_experts_native, priority=20, supports=_native)
registry.register("linear", "native", linear_native, priority=20, supports=_native)
registry.register("short_conv", "cpu", short_conv_cpu, priority=10, supports=_cpu_only)
registry.register("mla_attention", "cpu", mla_attention_cpu, priority=10, supports=_cpu_only)
registry.register("kda_chunk", "triton", kda_chunk_triton, priority=30, supports=_triton)
registry.register("kda_decode", "triton", kda_decode_triton, priority=30, supports=_triton)


class Kernels(NamedTuple):
    linear: Callable
    kda_chunk: Callable
    kda_recurrent: Callable
    kda_decode: Callable
    short_conv: Callable
    mla_attention: Callable
    moe_route: Callable
    moe_experts: Callable


def resolve_kernels(device: torch.device, backend: str | None = None) -> Kernels:
    return Kernels(*(registry.resolve(op, device, backend) for op in OPS))


__all__ = ["Kernels", "resolve_kernels", "use_backend", "OPS"]
