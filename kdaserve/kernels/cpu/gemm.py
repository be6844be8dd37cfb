"""fp32 matrix products on CPU: torch's sgemm (MKL) or oneDNN (torch.ops.mkldnn), by host.

MKL picks its kernels by CPU vendor: on AMD hosts it runs its AVX2 code even where AVX-512
is there, and it repacks the whole weight on every call. oneDNN picks by instruction set and
reads the plain [N, K] weight directly. Measured on a 2-core AMD EPYC with AVX-512 (the
bench model's shapes, fp32): 2048 x 768 -> 2566: 188 -> 444 GFLOP/s; 300 rows: 202 -> 434;
the 100k-row lm_head at 64 rows: 90.8 -> 27.5 ms. On Intel MKL runs its AVX-512 code and is
the faster of the two except where repacking a weight costs more than its product (an
lm_head at decode row counts): see `sgemm_preferred`. Same fp32 arithmetic, summed in another
order (differences at the 1e-6 relative level).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kdaserve.kernels.ref.quant import dequantize


@functools.cache
def onednn_usable() -> bool:
    """Whether this torch has oneDNN's linear and it computes F.linear (probed once)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(3, 40, generator=g), torch.randn(24, 40, generator=g)
        y = onednn_linear(x, w)
    except (AttributeError, RuntimeError):
        return False
    return bool(torch.allclose(y, F.linear(x, w), rtol=1e-5, atol=1e-5))


@functools.cache
def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD"; "" where unknown): the same
    instruction set runs at different rates on each, and oneDNN's small products with it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


# On Intel, MKL's sgemm beats oneDNN's products below this weight size at every row count
# measured (a 2-core Sapphire Rapids, alternated, ms F.linear / oneDNN: 2566 x 768 at 32 / 64 /
# 256 / 2,048 rows 1.21 / 1.53, 2.25 / 3.03, 6.54 / 7.20, 41.5 / 49.2; 768 x 128 at 64 0.09 /
# 0.19; the hidden-256 MoE's 256 x 256 at 64 0.065 / 0.115: oneDNN's primitive set-up is
# ~40-50 us a call); at the 100k x 768 lm_head MKL's per-call repacking loses (64 rows 139 /
# 80 ms).
SGEMM_MAX_WEIGHT = 16 * 2**20  # elements


@functools.cache
def mkl_on_intel() -> bool:
    """torch's sgemm is MKL and the host is Intel's (probed once: `gemm` asks on every call)."""
    return cpu_vendor() == "GenuineIntel" and torch.backends.mkl.is_available()


def sgemm_preferred(weight: torch.Tensor) -> bool:
    """Whether an fp32 product with this weight is faster through torch's sgemm (MKL)."""
    return weight.numel() < SGEMM_MAX_WEIGHT and mkl_on_intel()


def padded_rows(m: int) -> int:
    """The row count a product of m rows runs at. oneDNN compiles a kernel for each shape it
    meets (0.4-1.5 ms, then cached), and a prefill's experts and mixed steps bring new row
    counts all the time (the bench model's 2,048-token step: 439 expert products, 485 ->
    384 ms for its MoE layers once rounded). Rounding up keeps ~60 shapes per weight up to
    4,096 rows, for at most 1.5x the rows below 128 and 1.25x above (zero rows)."""
    for limit, step in ((16, 1), (128, 8), (512, 32), (2048, 128)):
        if m <= limit:
            return -(-m // step) * step
    return -(-m // 512) * 512


def gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (fp32; anything else, or no oneDNN: F.linear)."""
    if not (x.dtype == weight.dtype == torch.float32 and x.is_cpu and weight.is_contiguous()
            and x.numel() and onednn_usable()) or sgemm_preferred(weight):
        return F.linear(x, weight)
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    m = x2.shape[0]
    rows = padded_rows(m)
    if rows != m:
        x2 = torch.cat([x2, x2.new_zeros(rows - m, K)])
    y = onednn_linear(x2.contiguous(), weight)
    return y[:m].view(*x.shape[:-1], weight.shape[0])


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [None], "")


def linear_cpu(x: torch.Tensor, weight: torch.Tensor,
               scale: torch.Tensor | None = None) -> torch.Tensor:
    """`linear_ref`'s contract through `gemm` (the `cpu` backend's projections, where the
    native library cannot be built)."""
    return gemm(x, dequantize(weight, scale, x.dtype))
