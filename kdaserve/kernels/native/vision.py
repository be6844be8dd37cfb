"""The vision tower's ops in C++, behind their references' contracts (kernels/ref/vision.py):
attention in bf16 on the BF16 dot instruction (csrc/image_attention_cpu.cpp), the tanh GELU
and the 2-D RoPE in fp32 or bf16 (csrc/vision_cpu.cpp)."""

from __future__ import annotations

import functools
import math

import torch

from kdaserve.kernels.native.build import available, library
from kdaserve.kernels.native.tensors import ptr
from kdaserve.kernels.ref.vision import gelu_tanh_ref, image_attention_ref, rope_pairs_ref

_KINDS = {torch.float32: "f32", torch.bfloat16: "bf16"}
MAX_ROPE_DIM = 512  # kMaxRope in vision_cpu.cpp


@functools.cache
def image_attention_ready() -> bool:
    """Whether the library has the attention kernel: a host with AVX512-BF16 where the build
    asks for BF16 dots (isa.bf16_dots())."""
    return available()[0] and library().image_attention_ready() == 1


def image_attention_native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`image_attention_ref`'s contract. bf16 inputs run the native kernel; fp32 stays on
    torch's fused kernel, which already runs at the host's fp32 GEMM rate (172 GFLOP/s against
    sgemm's 161 at 1,024 patches on a Zen 4), as does a head dim that is not a multiple of 32."""
    L, H, D = q.shape
    strided = any(t.stride(-1) != 1 or t.stride(1) != D for t in (q, k, v))
    if not (q.dtype == k.dtype == v.dtype == torch.bfloat16) or D % 32 or strided \
            or not image_attention_ready():
        return image_attention_ref(q, k, v)
    o = torch.empty(L, H, D, dtype=torch.bfloat16)
    library().image_attention_bf16(ptr(q), q.stride(0), ptr(k), k.stride(0), ptr(v),
                                   v.stride(0), ptr(o), o.stride(0), L, H, D,
                                   1.0 / math.sqrt(D))
    return o


def gelu_tanh_native(x: torch.Tensor) -> torch.Tensor:
    """`gelu_tanh_ref`'s contract in one pass (fp32 or bf16 on the CPU)."""
    kind = _KINDS.get(x.dtype)
    if kind is None or not x.is_cpu:
        return gelu_tanh_ref(x)
    x = x.contiguous()
    y = torch.empty_like(x)
    getattr(library(), f"gelu_tanh_{kind}")(ptr(x), ptr(y), x.numel())
    return y


def rope_pairs_native(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rope_pairs_ref`'s contract in one pass (fp32 or bf16 on the CPU): rows of x may be
    strided (q and k as views of the fused projection), its heads contiguous."""
    L, H, D = x.shape
    kind = _KINDS.get(x.dtype)
    if kind is None or not x.is_cpu or D % 2 or D > MAX_ROPE_DIM or x.stride(-1) != 1 \
            or x.stride(1) != D or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        return rope_pairs_ref(x, cos, sin)
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(L, H, D, dtype=x.dtype)
    getattr(library(), f"rope_pairs_{kind}")(ptr(x), x.stride(0), ptr(cos), ptr(sin), ptr(out),
                                             L, H, D)
    return out
