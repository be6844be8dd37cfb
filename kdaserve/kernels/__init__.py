"""Public kernel ops, one function signature per op, resolved once at model build.

Ops (shapes in kernels/ref): `linear` (every projection), `kda_chunk` (prefill),
`kda_recurrent` (token by token: the oracle of the chunk form), `kda_decode` (a whole KDA
decode step, conv to gated norm), `short_conv`, `mla_attention`, `moe_route`, `moe_experts`,
`rms_norm`, `gated_rmsnorm` (KDA's output norm), `silu_mul` (the dense SwiGLU), and K3's
`situ_mul` (SiTU-GLU), `sigmoid_mul` (MLA's output gate) and `attn_res_norm` (the Attention
Residuals mix and the RMSNorm after it). Outside the text model's `Kernels`: `copy_slots` (the
state pool's) and the vision tower's `VisionKernels` (`image_attention`, `gelu_tanh`,
`rope_pairs`). A model that needs more of an
op than its base contract asks for a feature (`FEATURE_OPS`: K3's KDA gate, SiTU inside the
experts, MXFP4 experts) and gets only backends that declare it.
Every op has a `ref` backend (plain torch, the oracle); `cpu` is batched torch for decode
shapes; `native` is C++ compiled for the host on first use; `triton` runs fla-core's Triton
KDA kernels and our short conv, router, fused MoE and paged MLA on CUDA; `batch_invariant`
(C++, never chosen by priority) is the whole forward for deterministic inference. Importing
this package never imports triton or CUDA code.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kdaserve.kernels import interface as op
from kdaserve.kernels import registry
from kdaserve.kernels.ref.attn_res import attn_res_norm_ref
from kdaserve.kernels.ref.cache import copy_slots_ref
from kdaserve.kernels.ref.kda import (
    gated_rmsnorm,
    kda_chunk_ref,
    kda_decode_ref,
    kda_recurrent_ref,
    short_conv_ref,
)
from kdaserve.kernels.ref.mla import VERIFY_MAX_TOKENS, mla_attention_ref
from kdaserve.kernels.ref.mlp import sigmoid_mul_ref, silu_mul_ref, situ_mul_ref
from kdaserve.kernels.ref.moe import moe_experts_ref, moe_route_ref
from kdaserve.kernels.ref.norm import rms_norm_ref
from kdaserve.kernels.ref.quant import dequantize
from kdaserve.kernels.ref.vision import gelu_tanh_ref, image_attention_ref, rope_pairs_ref
from kdaserve.kernels.registry import use_backend


def _cpu_only(device: torch.device) -> tuple[bool, str]:
    return (device.type == "cpu", "" if device.type == "cpu" else "cpu backend needs a CPU")

def linear_ref(x: torch.Tensor, weight: torch.Tensor,
               scale: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T without bias: every projection of the model. A weight-only bf16 weight is
    widened to x's dtype; an int8 one comes with its per-row `scale`."""
    return F.linear(x, dequantize(weight, scale, x.dtype))


OPS = ("linear", "kda_chunk", "kda_recurrent", "kda_decode", "short_conv", "mla_attention",
       "moe_route", "moe_experts", "rms_norm", "gated_rmsnorm", "silu_mul", "situ_mul",
       "sigmoid_mul", "attn_res_norm")
BATCH_INVARIANT = "batch_invariant"
# feature -> the ops whose backends must have it: `kda_lower_bound` (K3's gate, the
# `lower_bound` keyword of the KDA ops), `situ` (SiTU-GLU experts, `moe_experts`' `situ`)
FEATURE_OPS: dict[str, tuple[str, ...]] = {
    "kda_lower_bound": ("kda_chunk", "kda_recurrent", "kda_decode"),
    "situ": ("moe_experts",),
    "mxfp4": ("moe_experts",),  # MXFP4 experts: uint8 w13 / w2 with E8M0 group scales
}
_K3_GATE = frozenset({"kda_lower_bound"})
# what the batch-invariant backend's kernels have: K3's gate, SiTU, and MXFP4 experts (each
# row decoded exactly to fp32); a feature missing here refuses a deterministic model when its
# kernels are resolved, not at its first forward
_BATCH_INVARIANT_FEATURES = {"kda_chunk": _K3_GATE, "kda_recurrent": _K3_GATE,
                             "kda_decode": _K3_GATE,
                             "moe_experts": frozenset({"situ", "mxfp4"})}

registry.register("linear", "ref", linear_ref)
registry.register("kda_chunk", "ref", kda_chunk_ref, features=_K3_GATE)
registry.register("kda_recurrent", "ref", kda_recurrent_ref, features=_K3_GATE)
registry.register("kda_decode", "ref", kda_decode_ref, features=_K3_GATE)
registry.register("short_conv", "ref", short_conv_ref)
registry.register("mla_attention", "ref", mla_attention_ref)
registry.register("moe_route", "ref", moe_route_ref)
registry.register("moe_experts", "ref", moe_experts_ref, features=frozenset({"situ", "mxfp4"}))
registry.register("rms_norm", "ref", rms_norm_ref)
registry.register("gated_rmsnorm", "ref", gated_rmsnorm)
registry.register("silu_mul", "ref", silu_mul_ref)
registry.register("situ_mul", "ref", situ_mul_ref)
registry.register("sigmoid_mul", "ref", sigmoid_mul_ref)  # on CUDA too: two torch ops
registry.register("attn_res_norm", "ref", attn_res_norm_ref)
# not a model op (no Kernels field): the state pool's batched slot copy, resolved by the pool
registry.register("copy_slots", "ref", copy_slots_ref)
# nor the vision tower's (`VisionKernels`): attention within an image, its MLP's tanh GELU and
# its 2-D RoPE; the references are torch ops, on CUDA too (SDPA)
registry.register("image_attention", "ref", image_attention_ref)
registry.register("gelu_tanh", "ref", gelu_tanh_ref)
registry.register("rope_pairs", "ref", rope_pairs_ref)

from kdaserve.kernels.cpu.decode import (  # noqa: E402 - registered after the references
    kda_decode_cpu,
    kda_recurrent_cpu,
    mla_attention_cpu,
    short_conv_cpu,
)
from kdaserve.kernels.cpu.gemm import linear_cpu  # noqa: E402
from kdaserve.kernels.cpu.moe import moe_experts_cpu  # noqa: E402
from kdaserve.kernels.native import batch_invariant as bi  # noqa: E402
from kdaserve.kernels.native import build as native_build  # noqa: E402
from kdaserve.kernels.native.cache import copy_slots_native  # noqa: E402
from kdaserve.kernels.native.k3 import (  # noqa: E402
    attn_res_norm_native,
    sigmoid_mul_native,
    situ_mul_native,
)
from kdaserve.kernels.native.ops import (  # noqa: E402
    argmax_rows,
    gated_rmsnorm_native,
    kda_chunk_native,
    kda_chunk_native_wy,
    kda_decode_native,
    linear_native,
    mla_attention_native,
    moe_experts_native,
    moe_route_native,
    rms_norm_native,
    short_conv_native,
    silu_mul_native,
)
from kdaserve.kernels.native.vision import (  # noqa: E402
    gelu_tanh_native,
    image_attention_native,
    image_attention_ready,
    rope_pairs_native,
)
from kdaserve.kernels.triton import supports as _triton  # noqa: E402
from kdaserve.kernels.triton import tile  # noqa: E402
from kdaserve.kernels.triton.conv import short_conv_triton  # noqa: E402
from kdaserve.kernels.triton.k3 import attn_res_norm_triton, situ_mul_triton  # noqa: E402
from kdaserve.kernels.triton.kda import (  # noqa: E402
    FUSED_MAX_STATE,
    kda_chunk_triton,
    kda_decode_triton,
)
from kdaserve.kernels.triton.mla import mla_attention_triton  # noqa: E402
from kdaserve.kernels.triton.moe import moe_experts_triton, moe_route_triton  # noqa: E402

_ONE_CALL = frozenset({registry.ONE_CALL_DECODE})
_GRAPH = frozenset({registry.GRAPH_SAFE})


def _native(device: torch.device) -> tuple[bool, str]:
    # Compiling happens here, once, when the first model is built on a CPU.
    return native_build.available() if device.type == "cpu" else (False, "needs a CPU")


def _image_attention(device: torch.device) -> tuple[bool, str]:
    ok, reason = _native(device)
    if ok and not image_attention_ready():
        return False, "needs AVX512-BF16 with the BF16 dots asked for (isa.bf16_dots())"
    return ok, reason


registry.register("kda_recurrent", "cpu", kda_recurrent_cpu, priority=10, supports=_cpu_only,
                  features=_K3_GATE)
registry.register("kda_decode", "cpu", kda_decode_cpu, priority=10, supports=_cpu_only,
                  features=_K3_GATE)
registry.register("kda_decode", "native", kda_decode_native, priority=20, supports=_native,
                  features=_K3_GATE, capabilities=_ONE_CALL)
registry.register("kda_chunk", "native", kda_chunk_native, priority=20, supports=_native,
                  features=_K3_GATE)
registry.register("kda_chunk", "native_wy", kda_chunk_native_wy, priority=15, supports=_native,
                  features=_K3_GATE)
registry.register("mla_attention", "native", mla_attention_native, priority=20,
                  supports=_native, capabilities=_ONE_CALL)
registry.register("moe_experts", "cpu", moe_experts_cpu, priority=10, supports=_cpu_only,
                  features=frozenset({"mxfp4"}))  # dequantizes the experts a batch touches
registry.register("moe_experts", "native", moe_experts_native, priority=20, supports=_native,
                  features=frozenset({"situ", "mxfp4"}), capabilities=_ONE_CALL)
registry.register("moe_route", "native", moe_route_native, priority=20, supports=_native,
                  capabilities=_ONE_CALL)
registry.register("silu_mul", "native", silu_mul_native, priority=20, supports=_native,
                  capabilities=_ONE_CALL)
registry.register("situ_mul", "native", situ_mul_native, priority=20, supports=_native,
                  capabilities=_ONE_CALL)
registry.register("sigmoid_mul", "native", sigmoid_mul_native, priority=20, supports=_native,
                  capabilities=_ONE_CALL)
registry.register("attn_res_norm", "native", attn_res_norm_native, priority=20,
                  supports=_native, capabilities=_ONE_CALL)
registry.register("copy_slots", "native", copy_slots_native, priority=20, supports=_native)
registry.register("image_attention", "native", image_attention_native, priority=20,
                  supports=_image_attention)
registry.register("gelu_tanh", "native", gelu_tanh_native, priority=20, supports=_native)
registry.register("rope_pairs", "native", rope_pairs_native, priority=20, supports=_native)
registry.register("linear", "cpu", linear_cpu, priority=10, supports=_cpu_only)
registry.register("linear", "native", linear_native, priority=20, supports=_native,
                  capabilities=_ONE_CALL)
registry.register("short_conv", "cpu", short_conv_cpu, priority=10, supports=_cpu_only)
registry.register("short_conv", "native", short_conv_native, priority=20, supports=_native)
registry.register("mla_attention", "cpu", mla_attention_cpu, priority=10, supports=_cpu_only)
registry.register("kda_chunk", "triton", kda_chunk_triton, priority=30, supports=_triton,
                  features=_K3_GATE)
registry.register("kda_decode", "triton", kda_decode_triton, priority=30, supports=_triton,
                  features=_K3_GATE, capabilities=_GRAPH)
registry.register("moe_experts", "triton", moe_experts_triton, priority=30, supports=_triton,
                  features=frozenset({"situ", "mxfp4"}),
                  capabilities=_GRAPH | {registry.FUSED_SHARED_EXPERT})
registry.register("situ_mul", "triton", situ_mul_triton, priority=30, supports=_triton)
registry.register("attn_res_norm", "triton", attn_res_norm_triton, priority=30,
                  supports=_triton)
registry.register("moe_route", "triton", moe_route_triton, priority=30, supports=_triton,
                  capabilities=_GRAPH)
registry.register("short_conv", "triton", short_conv_triton, priority=30, supports=_triton)
registry.register("mla_attention", "triton", mla_attention_triton, priority=30,
                  supports=_triton, capabilities=_GRAPH)


def _batch_invariant(device: torch.device) -> tuple[bool, str]:
    if device.type != "cpu":
        return False, "deterministic inference is implemented for the CPU (fp32) path"
    return native_build.available(BATCH_INVARIANT)


# Below every other backend (priority -1): chosen only by name, for deterministic inference.
for _op, _fn in (("linear", bi.linear_bi), ("kda_chunk", bi.kda_chunk_bi),
                 ("kda_recurrent", bi.kda_chunk_bi), ("kda_decode", bi.kda_decode_bi),
                 ("short_conv", bi.short_conv_bi), ("mla_attention", bi.mla_attention_bi),
                 ("moe_route", bi.moe_route_bi), ("moe_experts", bi.moe_experts_bi),
                 ("rms_norm", bi.rms_norm_bi), ("gated_rmsnorm", bi.gated_rmsnorm_bi),
                 ("silu_mul", bi.silu_mul_bi), ("situ_mul", bi.situ_mul_bi),
                 ("sigmoid_mul", bi.sigmoid_mul_bi), ("attn_res_norm", bi.attn_res_norm_bi)):
    registry.register(_op, BATCH_INVARIANT, _fn, priority=-1, supports=_batch_invariant,
                      features=_BATCH_INVARIANT_FEATURES.get(_op, frozenset()))


registry.register("rms_norm", "native", rms_norm_native, priority=20, supports=_native,
                  capabilities=_ONE_CALL)
registry.register("gated_rmsnorm", "native", gated_rmsnorm_native, priority=20,
                  supports=_native)


class Kernels(NamedTuple):
    """One callable per op, typed by its Protocol (kernels/interface.py)."""
    linear: op.Linear
    kda_chunk: op.KdaChunk
    kda_recurrent: op.KdaRecurrent
    kda_decode: op.KdaDecode
    short_conv: op.ShortConv
    mla_attention: op.MlaAttention
    moe_route: op.MoeRoute
    moe_experts: op.MoeExperts
    rms_norm: op.RmsNorm
    gated_rmsnorm: op.GatedRmsNorm
    silu_mul: op.SiluMul
    situ_mul: op.SituMul
    sigmoid_mul: op.SigmoidMul
    attn_res_norm: op.AttnResNorm
    # Whether MoE layers run their shared expert inside `moe_experts`, as one more expert
    # every token takes with weight 1 (stacked after the routed ones): on a GPU that saves its
    # own GEMMs' and SwiGLU's launches and rides the grouped GEMM's blocks. The CPU backends
    # keep it a dense MLP: the native one-call decode runs it as one GEMM over the batch,
    # faster there than one more expert's tiles.
    fuse_shared_expert: bool = False
    features: frozenset[str] = frozenset()  # what the model asked for (FEATURE_OPS)
    # (op, capability) of every op's chosen backend (registry.Backend.capabilities)
    capabilities: frozenset[tuple[str, str]] = frozenset()

    def have(self, capability: str, ops: tuple[str, ...]) -> bool:
        """Whether the backends chosen for all of `ops` declare `capability`."""
        return all((op, capability) in self.capabilities for op in ops)


class VisionKernels(NamedTuple):
    """The vision tower's ops (models/vision.py), one callable each."""
    image_attention: op.ImageAttention
    gelu_tanh: op.GeluTanh
    rope_pairs: op.RopePairs


VISION_OPS = VisionKernels._fields
REF_VISION = VisionKernels(image_attention_ref, gelu_tanh_ref, rope_pairs_ref)


def resolve_vision_kernels(device: torch.device, backend: str | None = None) -> VisionKernels:
    """Each tower op's callable on `device` (`backend` forced where it has one)."""
    return VisionKernels(*(registry.resolve(o, device, backend) for o in VISION_OPS))


def graph_verify_tokens(kda_head_dims: Iterable[int]) -> int:
    """The most new tokens per sequence a graph-safe (Triton) verify step takes in its fused
    kernels, which read no lengths back: the absorbed MLA path's limit, and none at all (0)
    where a KDA layer's state tile is too large for the fused decode step."""
    if any(tile(d) ** 2 > FUSED_MAX_STATE for d in kda_head_dims):
        return 0
    return VERIFY_MAX_TOKENS


def resolve_kernels(device: torch.device, backend: str | None = None,
                    deterministic: bool = False,
                    features: frozenset[str] = frozenset()) -> Kernels:
    """Each op's callable on `device`. `deterministic`: every op from the batch-invariant
    backend, with no fallback (an op without one, or a device it does not support, raises).
    `features` (FEATURE_OPS' keys, ModelConfig.kernel_features): backends that have them."""
    unknown = features - set(FEATURE_OPS)
    if unknown:
        raise ValueError(f"unknown kernel features {sorted(unknown)}")

    def needs(op: str) -> frozenset[str]:
        return frozenset(f for f in features if op in FEATURE_OPS[f])

    chosen = [registry.resolve_backend(op, device, BATCH_INVARIANT if deterministic
                                       else backend, strict=deterministic, features=needs(op))
              for op in OPS]
    capabilities = frozenset((b.op, c) for b in chosen for c in b.capabilities)
    return Kernels(*(b.fn for b in chosen), features=features, capabilities=capabilities,
                   fuse_shared_expert=("moe_experts", registry.FUSED_SHARED_EXPERT)
                   in capabilities)


__all__ = ["Kernels", "resolve_kernels", "use_backend", "OPS", "BATCH_INVARIANT", "argmax_rows",
           "VisionKernels", "VISION_OPS", "REF_VISION", "resolve_vision_kernels"]
