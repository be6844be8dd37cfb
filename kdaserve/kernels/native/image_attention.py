"""The vision tower's attention in bf16 on the BF16 dot instruction
(csrc/image_attention_cpu.cpp), behind `image_attention_ref`'s contract."""

from __future__ import annotations

import functools
import math

import torch

from kdaserve.kernels.native.build import available, library
from kdaserve.kernels.native.tensors import ptr
from kdaserve.kernels.ref.image_attention import image_attention_ref


@functools.cache
def image_attention_ready() -> bool:
    """Whether the library has the kernel: a host with AVX512-BF16 where the build asks for
    BF16 dots (isa.bf16_dots())."""
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
