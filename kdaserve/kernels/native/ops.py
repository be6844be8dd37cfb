"""The `native` backend: C++ kernels (csrc/kda_cpu.cpp, csrc/gemm_cpu.cpp) behind the op
signatures.

Each wrapper checks what the kernel handles (fp32, contiguous, one token per sequence, head
dims up to MAX_HEAD_DIM) and otherwise hands the call to the torch `cpu` backend, so forcing
`native` is always safe.
"""

from __future__ import annotations

import functools

import torch

from kdaserve.kernels.cpu.decode import kda_decode_cpu, mla_attention_cpu, short_conv_cpu
from kdaserve.kernels.cpu.gemm import cpu_vendor, gemm, onednn_usable
from kdaserve.kernels.cpu.moe import moe_experts_cpu
from kdaserve.kernels.native import isa
from kdaserve.kernels.native.build import MAX_HEAD_DIM, available, library
from kdaserve.kernels.native.k3 import moe_experts_mxfp4
from kdaserve.kernels.native.tensors import f32 as _f32
from kdaserve.kernels.native.tensors import ptr as _ptr
from kdaserve.kernels.ref.kda import Snapshots, gated_rmsnorm, kda_chunk_ref
from kdaserve.kernels.ref.mla import VERIFY_MAX_TOKENS, mla_split_chunks
from kdaserve.kernels.ref.mlp import silu_mul_ref
from kdaserve.kernels.ref.moe import moe_experts_ref, moe_route_ref
from kdaserve.kernels.ref.norm import rms_norm_ref
from kdaserve.kernels.ref.quant import dequantize


def kda_decode_native(qkv: torch.Tensor, f: torch.Tensor, beta: torch.Tensor, z: torch.Tensor,
                      conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                      norm_weight: torch.Tensor, eps: float, state: torch.Tensor,
                      conv_state: torch.Tensor, state_slots: torch.Tensor,
                      cu_seqlens: torch.Tensor | None = None,
                      lower_bound: float | None = None) -> torch.Tensor:
    """Same contract as `kda_decode_ref`; the state pools are updated in place by the kernel,
    so they must be contiguous (they are: slices of the pool along its first dimension)."""
    T, H, K = f.shape
    V = z.shape[-1]
    if not (_f32(qkv, f, beta, z, conv_weight, A_log, dt_bias, norm_weight, state, conv_state)
            and state.is_contiguous() and conv_state.is_contiguous()
            and max(K, V) <= MAX_HEAD_DIM):
        return kda_decode_cpu(qkv, f, beta, z, conv_weight, A_log, dt_bias, norm_weight, eps,
                              state, conv_state, state_slots, cu_seqlens, lower_bound)
    # bound to names: a temporary's memory would be freed before the call
    qkv, f, beta, z, conv_weight, A_log, dt_bias, norm_weight = (
        t.contiguous() for t in (qkv, f, beta, z, conv_weight, A_log, dt_bias, norm_weight))
    slots = state_slots.to(torch.int64).contiguous()
    cu = None if cu_seqlens is None else cu_seqlens.to(torch.int64).contiguous()
    out = torch.empty(T, H, V, dtype=torch.float32)
    library().kda_decode_f32(
        _ptr(qkv), _ptr(f), _ptr(beta), _ptr(z), _ptr(conv_weight), _ptr(A_log), _ptr(dt_bias),
        _ptr(norm_weight), _ptr(state), _ptr(conv_state), _ptr(slots),
        None if cu is None else _ptr(cu), _ptr(out), slots.shape[0], H, K, V,
        conv_weight.shape[1], eps, _bound(lower_bound))
    return out


def _bound(lower_bound: float | None) -> float:
    """The kernels' lower_bound argument: 0 for Kimi Linear's gate (a K3 bound is < 0)."""
    if lower_bound is not None and not lower_bound < 0:
        raise ValueError(f"a KDA gate lower bound must be negative, got {lower_bound}")
    return 0.0 if lower_bound is None else lower_bound


def _prefill_native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    *rest: torch.Tensor) -> bool:
    """Whether the C++ prefill kernels take these inputs (else the reference runs); the
    state pool comes last."""
    return _f32(q, k, v, *rest) and rest[-1].is_contiguous() and \
        max(q.shape[-1], v.shape[-1]) <= MAX_HEAD_DIM


def _snap_rows(T: int, snapshots: Snapshots | None) -> torch.Tensor | None:
    """[T] pool row to copy the state to after each row, -1 for none (None: no snapshots)."""
    if snapshots is None or not snapshots[0].numel():
        return None
    snap = torch.full((T,), -1, dtype=torch.int64)
    snap[snapshots[0]] = snapshots[1].to(torch.int64)
    return snap


def _kda_prefill(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 g: torch.Tensor, beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                 state: torch.Tensor, state_slots: torch.Tensor, cu_seqlens: torch.Tensor,
                 snapshots: Snapshots | None, lower_bound: float | None) -> torch.Tensor:
    T, H, K = q.shape
    if not _prefill_native(q, k, v, g, beta, A_log, dt_bias, state):
        return kda_chunk_ref(q, k, v, g, beta, A_log, dt_bias, state, state_slots, cu_seqlens,
                             snapshots, lower_bound)
    V = v.shape[-1]
    q, k, v, g, beta, A_log, dt_bias = (
        t.contiguous() for t in (q, k, v, g, beta, A_log, dt_bias))
    slots = state_slots.to(torch.int64).contiguous()
    cu = cu_seqlens.to(torch.int64).contiguous()
    snap = _snap_rows(T, snapshots)
    out = torch.empty(T, H, V, dtype=torch.float32)
    getattr(library(), kernel)(
        _ptr(q), _ptr(k), _ptr(v), _ptr(g), _ptr(beta), _ptr(A_log), _ptr(dt_bias),
        _ptr(state), _ptr(slots), _ptr(cu),
        None if snap is None else _ptr(snap), _ptr(out), cu.shape[0] - 1, H, K, V,
        _bound(lower_bound))
    return out


def short_conv_native(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                      state_slots: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Same contract as `short_conv_ref`, one C++ pass over every sequence (the reference
    loops over sequences in Python: 1.2 ms for 16 verifying requests of 5 tokens)."""
    if not (_f32(x, weight, conv_state) and conv_state.is_contiguous()):
        return short_conv_cpu(x, weight, conv_state, state_slots, cu_seqlens)
    xc = x if x.dim() == 2 and x.stride(1) == 1 else x.contiguous()  # rows may be strided
    wt = weight.t().contiguous()
    slots = state_slots.to(torch.int64).contiguous()
    cu = cu_seqlens.to(torch.int64).contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    C, W = weight.shape
    library().short_conv_f32(_ptr(xc), xc.stride(0), _ptr(wt), _ptr(conv_state), _ptr(slots),
                             _ptr(cu), _ptr(out), cu.shape[0] - 1, C, W)
    return out


def kda_chunk_native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                     state: torch.Tensor, state_slots: torch.Tensor, cu_seqlens: torch.Tensor,
                     snapshots: Snapshots | None = None,
                     lower_bound: float | None = None) -> torch.Tensor:
    """Same contract as `kda_chunk_ref` (packed ragged sequences, states in place, optional
    snapshots written as the kernel passes their rows), computed as a token-serial scan per
    (sequence, head, block of value columns): measured faster here than the chunk form."""
    T, H, K = q.shape
    if not _prefill_native(q, k, v, g, beta, A_log, dt_bias, state):
        return kda_chunk_ref(q, k, v, g, beta, A_log, dt_bias, state, state_slots, cu_seqlens,
                             snapshots, lower_bound)
    V = v.shape[-1]
    # q, k, v may be column slices of the conv output (rows strided, heads and channels
    # packed): read in place; anything else is copied
    q, k, v = (t if t.stride()[1:] == (t.shape[2], 1) else t.contiguous() for t in (q, k, v))
    beta = beta if beta.stride(1) == 1 else beta.contiguous()
    g = g.contiguous()
    slots = state_slots.to(torch.int64).contiguous()
    cu = cu_seqlens.to(torch.int64).contiguous()
    snap = _snap_rows(T, snapshots)
    out = torch.empty(T, H, V, dtype=torch.float32)
    scratch = torch.empty(3 * T * H * K + T * H, dtype=torch.float32)
    library().kda_prefill_f32(
        _ptr(q), _ptr(k), _ptr(v), q.stride(0), k.stride(0), v.stride(0), _ptr(g), _ptr(beta),
        beta.stride(0), _ptr(A_log.contiguous()), _ptr(dt_bias.contiguous()), _ptr(state),
        _ptr(slots), _ptr(cu), None if snap is None else _ptr(snap), _ptr(out), cu.shape[0] - 1,
        H, K, V, T, _ptr(scratch), _bound(lower_bound))
    return out


def kda_chunk_native_wy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                        state: torch.Tensor, state_slots: torch.Tensor,
                        cu_seqlens: torch.Tensor, snapshots: Snapshots | None = None,
                        lower_bound: float | None = None) -> torch.Tensor:
    """The chunk (WY / UT) form in C++ (16-token chunks), the same contract: registered
    below the scan, so it is tested and timed (`bench kernels`) but chosen only by name."""
    return _kda_prefill("kda_chunked_f32", q, k, v, g, beta, A_log, dt_bias, state,
                        state_slots, cu_seqlens, snapshots, lower_bound)


def mla_attention_native(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                         block_table: torch.Tensor, cu_seqlens: torch.Tensor,
                         context_lens: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                         scale: float, max_seqlen: int = 0) -> torch.Tensor:
    """Decode attention computed against the compressed latents where they lie in the block
    pool (no gather copy), the W_UK / W_UV absorptions in the same C++ call (as two `bmm`s
    they cost a small model's decode step ~30 us a layer in dispatch). Sequences of up to
    VERIFY_MAX_TOKENS new tokens each (speculative verifies) are one task each: every token
    sees the cache up to its own position (their latents are already in the pool, so
    causality is just each token's context length)."""
    B, H = q_nope.shape[0], q_nope.shape[1]
    if not _f32(q_nope, q_pe, kv_cache, w_uk, w_uv) or not kv_cache.is_contiguous() \
            or q_nope.stride(-1) != 1 or w_uk.stride(-1) != 1:
        return mla_attention_cpu(q_nope, q_pe, kv_cache, block_table, cu_seqlens, context_lens,
                                 w_uk, w_uv, scale)
    S = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.to(torch.int64).contiguous()
    if S != B:
        new = cu[1:] - cu[:-1]
        if int(new.max()) > VERIFY_MAX_TOKENS:  # chunks to the prefill path
            return mla_split_chunks(mla_attention_native, mla_attention_cpu, q_nope, q_pe,
                                    kv_cache, block_table, cu, context_lens, w_uk, w_uv,
                                    scale)
    T, Dn, Dr, Dv, R = q_nope.shape[0], q_nope.shape[-1], q_pe.shape[-1], w_uv.shape[1], \
        w_uk.shape[-1]
    q = _joined(q_nope, q_pe, 2)
    w_kvb = _joined(w_uk, w_uv, 1)
    if w_kvb.stride(0) != w_kvb.shape[1] * R:
        w_kvb = w_kvb.contiguous()
    table = block_table.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    out = torch.empty(T, H, Dv, dtype=torch.float32)
    library().mla_forward_f32(
        _ptr(q), q.stride(0), _ptr(w_kvb), _ptr(kv_cache), _ptr(table), _ptr(lens), _ptr(cu),
        _ptr(out), S, T, H, Dn, Dr, Dv, R, kv_cache.shape[1], table.shape[1], scale)
    return out


def _joined(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
    """torch.cat([a, b], dim) of two 3-D tensors, as the view both already are parts of where
    they are (q's nope and rope columns per head, kv_b_proj's W_UK and W_UV rows per head),
    else a copy; either way contiguous in its last two dimensions."""
    shape = list(a.shape)
    shape[dim] += b.shape[dim]
    inner = (shape[1] * shape[2], shape[2], 1)
    if a.stride()[1:] == inner[1:] == b.stride()[1:] and a.stride(0) >= inner[0] \
            and b.stride(0) == a.stride(0) and b.data_ptr() == a.data_ptr() \
            + a.shape[dim] * a.stride(dim) * a.element_size():
        return a.as_strided(shape, (a.stride(0), *inner[1:]))
    return torch.cat([a, b], dim=dim).contiguous()


# fp32 activations against weights of this dtype: (linear kernel, MoE kernel). bf16 weights
# are weight-only bf16 (`--dtype bfloat16` on a CPU): half the bytes, widened in registers.
_WEIGHT_KERNELS = {torch.float32: ("linear_small_f32", "moe_experts_f32"),
                   torch.bfloat16: ("linear_small_bf16w", "moe_experts_bf16w"),
                   torch.int8: ("linear_small_int8w", "moe_experts_int8w")}


@functools.cache  # asked by every projection's row cap (~50 times a decode step)
def avx512() -> bool:
    """Whether the native kernels run 16-lane AVX-512 code (the host's, or KDASERVE_ISA's cap)."""
    return isa.at_least("avx512")


# An expert's tokens from this many on run as whole-expert token blocks in the broadcast tiles
# (moe_cpu.cpp); fewer split its weight rows over the threads. Measured on a 2-core Xeon with
# AVX-512 (64 experts top-8 at hidden 768, ms rows split / blocked from 16 / blocked from 8:
# 64 tokens 8.1 / 7.9 / 10.8; 2,048 tokens 140 / 76-108 / 78-108) and with the same kernels
# built for AVX2 (8 lanes, 32-token blocks: 64 tokens 9.7 / 9.5 / 7.8; 256: 27.6 / 19.0 / 21.3).
# The per-expert oneDNN/MKL GEMMs of the `cpu` backend were slower at every size (2,048
# tokens 124-183 ms; gathering and scattering through torch cost more than the products).
# bf16 and int8 experts' blocks run on AMX tiles where the host has them, which pay from
# fewer tokens (block / row split, ms a layer, 7 layers cold: 64 tokens 5.8 / 6.3, 128
# tokens 7.3 / 8.8; 16 and 32 tokens equal).
MOE_BLOCKED_FROM, MOE_BLOCKED_FROM_AVX2, MOE_BLOCKED_FROM_AMX = 16, 8, 8


def moe_blocked_from(expert_dtype: torch.dtype = torch.float32) -> int:
    if expert_dtype in (torch.bfloat16, torch.int8) and amx():
        return MOE_BLOCKED_FROM_AMX
    return MOE_BLOCKED_FROM if avx512() else MOE_BLOCKED_FROM_AVX2


def moe_experts_native(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                       w13: torch.Tensor, w2: torch.Tensor, scale13: torch.Tensor | None = None,
                       scale2: torch.Tensor | None = None,
                       situ: tuple[float, float | None] | None = None,
                       blocked_from: int | None = None) -> torch.Tensor:
    """Same contract as `moe_experts_ref`, in one C++ call at any batch (blocked_from: see
    MOE_BLOCKED_FROM; tests force either way). `situ`: K3's SiTU-GLU experts (the weighted
    sum is fp32 here whatever the experts)."""
    T, k = ids.shape
    if w13.dtype == torch.uint8:  # MXFP4 (kernels/ref/mxfp4.py)
        return moe_experts_mxfp4(x, weights, ids, w13, w2, scale13, scale2, situ)
    kernel = _WEIGHT_KERNELS.get(w13.dtype, ("", ""))[1]
    blocked_from = moe_blocked_from(w13.dtype) if blocked_from is None else blocked_from
    beta, linear_beta = (situ[0], situ[1] or 0.0) if situ else (0.0, 0.0)
    if situ and (beta <= 0 or linear_beta < 0):
        raise ValueError(f"SiTU's betas must be positive, got {situ}")
    if not kernel or not _f32(x) \
            or w2.dtype != w13.dtype or not w13.is_contiguous() or not w2.is_contiguous():
        if situ:
            return moe_experts_ref(x, weights, ids, w13, w2, scale13, scale2, situ=situ)
        return moe_experts_cpu(x, weights, ids, w13, w2, scale13, scale2)
    x = x.contiguous()
    ids = ids.to(torch.int64).contiguous()
    weights = weights.float().contiguous()
    out = torch.empty_like(x)
    E, inter, D = w13.shape[0], w2.shape[-1], x.shape[1]
    if w13.dtype == torch.int8:
        assert scale13 is not None and scale2 is not None, "int8 experts come with scales"
        s13, s2 = scale13.contiguous(), scale2.contiguous()
        library().moe_experts_int8w(_ptr(x), _ptr(ids), _ptr(weights), _ptr(w13), _ptr(w2),
                                   _ptr(s13), _ptr(s2), _ptr(out), T, k, E, inter, D, blocked_from,
                                   beta, linear_beta)
    else:
        getattr(library(), kernel)(_ptr(x), _ptr(ids), _ptr(weights), _ptr(w13), _ptr(w2),
                                   _ptr(out), T, k, E, inter, D, blocked_from, beta, linear_beta)
    return out


def moe_route_native(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                     num_group: int, topk_group: int, renormalize: bool, scaling: float,
                     activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_route_ref`'s contract in one C++ call (torch's ~12 small ops cost ~45 us a call
    at any batch; ties between equal scores go to the lower expert index)."""
    T, E = logits.shape
    f32 = torch.float32
    if logits.dtype != f32 or not logits.is_cpu or (bias is not None and bias.dtype != f32) \
            or activation not in ("sigmoid", "softmax") or not 0 < top_k <= E:
        return moe_route_ref(logits, bias, top_k, num_group, topk_group, renormalize, scaling,
                             activation)
    logits = logits.contiguous()
    b = None if bias is None else bias.contiguous()
    weights = torch.empty(T, top_k, dtype=torch.float32)
    ids = torch.empty(T, top_k, dtype=torch.int64)
    library().moe_route_f32(_ptr(logits), None if b is None else _ptr(b), _ptr(weights),
                            _ptr(ids), T, E, top_k, num_group, topk_group, int(renormalize),
                            int(activation == "sigmoid"), scaling)
    return weights, ids


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_ref`'s contract in one C++ pass for fp32 (a decode step's norms are
    dispatch-bound: 20-27 us a call in torch against 6-11 us, 1 to 80 rows of 256); rows may
    be a column slice of a wider tensor (MLA's latent part of kv_a's output)."""
    D = x.shape[-1]
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or not x.is_cpu or \
            x.dim() != 2 or x.stride(-1) != 1 or not weight.is_contiguous():
        if x.dim() != 2 and x.is_contiguous() and x.dtype == torch.float32 and x.is_cpu:
            return rms_norm_native(x.view(-1, D), weight, eps).view(x.shape)
        return rms_norm_ref(x, weight, eps)
    y = torch.empty(x.shape[0], D, dtype=torch.float32)
    library().rms_norm_f32(_ptr(x), x.stride(0), _ptr(weight), _ptr(y), x.shape[0], D, eps)
    return y


def gated_rmsnorm_native(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                         eps: float) -> torch.Tensor:
    """`gated_rmsnorm`'s contract in one C++ pass for fp32, as the fused decode step computes
    it (torch's six ops over a 2,048-token prefill's [T, H, V]: ~6 ms a KDA layer)."""
    if not _f32(o, gate, weight) or o.shape != gate.shape or weight.shape != o.shape[-1:] \
            or o.shape[-1] > MAX_HEAD_DIM:
        return gated_rmsnorm(o, gate, weight, eps)
    o, gate, weight = o.contiguous(), gate.contiguous(), weight.contiguous()
    out = torch.empty_like(o)
    V = o.shape[-1]
    library().gated_rmsnorm_f32(_ptr(o), _ptr(gate), _ptr(weight), _ptr(out), o.numel() // V, V,
                                eps)
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, V] -> int64 [B], `x.argmax(-1)` (ties to the first, a NaN wins), in one C++
    pass for fp32 CPU rows (torch's reduction is scalar: 8.4 ms for 64 x 100k, against
    ~1 ms); anything else goes to torch."""
    if x.dtype != torch.float32 or not x.is_cpu or x.dim() != 2 or not x.shape[1] \
            or x.stride(-1) != 1 or x.stride(0) != x.shape[1] or not available()[0]:
        return x.argmax(-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    library().argmax_rows_f32(_ptr(x), x.shape[0], x.shape[1], _ptr(out))
    return out


def silu_mul_native(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu_mul_ref`'s contract (SiLU(gate) * up of [..., gate | up]) in one C++ pass; torch
    takes three ops (~20 us a call at a decode step's few rows)."""
    if gate_up.dtype != torch.float32 or not gate_up.is_cpu:
        return silu_mul_ref(gate_up)
    x = gate_up.contiguous()
    inter = x.shape[-1] // 2
    y = x.new_empty(*x.shape[:-1], inter)
    library().silu_mul_f32(x.data_ptr(), y.data_ptr(), x.numel() // (2 * inter) if inter else 0,
                           inter)
    return y


# Up to this many rows the native GEMM streams the weights faster than sgemm, which packs the
# whole weight on every call (measured crossover between 32 and 48 rows on the bench model's
# projections). A weight as large as an lm_head costs sgemm so much packing that the native
# GEMM stays ahead far longer (100k x 768 on AVX2: 1.49x at 32 rows, 1.23x at 64, 1.15x at 128).
LINEAR_NATIVE_MAX_ROWS = 32
LARGE_WEIGHT = 16 * 2**20  # elements (64 MB in fp32)
LARGE_WEIGHT_MAX_ROWS = 128
# oneDNN (`gemm`) reads the plain weight without repacking. On AMD's AVX-512 the native GEMM is
# ahead of it at every row count to 32 since gemm_cpu.cpp's narrow tiles (fp32, 4-24 rows;
# 2-core Zen 4, ms native / oneDNN, weights cycled past the L3: the 100k x 768 lm_head at 8 /
# 16 / 24 / 32 rows 10.5 / 16.7, 12.5 / 21.8, 21.1 / 31.4, 35.2 / 37.3; 3072 x 768 0.28 / 0.53,
# 0.38 / 0.71, 0.57 / 1.03, 0.92 / 1.19; 768 x 2048 0.25 / 0.33, 0.32 / 0.43, 0.64 / 0.76,
# 0.65 / 0.79; 384 x 768 0.05 / 0.10 at 8 rows, 0.13 / 0.17 at 32), and its broadcast tiles
# to 64 rows for inputs up to 1,024 wide (at 48 / 64 rows: the lm_head 38.6 / 44.1, 52.4 /
# 55.5; 3072 x 768 1.16 / 1.44, 1.58 / 1.79; 384 x 768 0.16 / 0.21, 0.22 / 0.26), to 48 for
# wider ones (768 x 2048 0.90 / 0.94, 1.23 / 1.16). Before the narrow
# tiles oneDNN took fp32 from 5 rows there (the lm_head at 8 rows: 14.2 ms on the dot tiles,
# 11.3 oneDNN).
# oneDNN's AVX2 code pays ~0.1 ms a call and runs skinny products at 20-80 GFLOP/s,
# where the broadcast tiles reach 80-120: there fp32 stays native up to 96 rows, 64 when the
# input is wider than 512 (a tile's x^T strip then outgrows L1) or the weight is
# lm_head-sized (AVX2 AMD EPYC, GFLOP/s native / oneDNN at 32 / 64 / 96 / 128 rows:
# 900 x 256 91 / 55, 84 / 78, 95 / 86, 103 / 95; 1536 x 256 109 / 69, 106 / 93, 109 / 107,
# 112 / 100; 256 x 768 74 / 56, 70 / 76, 59 / 90; 2816 x 768 102 / 85, 89 / 85, 80 / 104;
# 256 x 256 61 / 23, 69 / 40, 79 / 59, 65 / 65; the 100k x 768 lm_head at 16 / 32 / 64 /
# 128 rows, ms, 38 / 59, 53 / 68, 93 / 159, 331 / 234).
ONEDNN_NATIVE_MAX_ROWS, ONEDNN_NATIVE_MAX_ROWS_WIDE = 64, 48
# On Intel's AVX-512 (a 2-core Sapphire Rapids Xeon, stop 33, after the broadcast tiles came to
# store y^T whole) oneDNN's small products are slower, and the crossover is far later (ms
# native / oneDNN, best of 3 alternated: 2566 x 768 at 8 / 16 / 32 / 64 rows 0.36 / 0.61,
# 0.63 / 0.79, 1.20 / 1.19, 1.95 / 1.90; 768 x 768 at 16 0.16 / 0.22, at 64 0.61 / 0.51; the
# 100k-row lm_head at 8 / 16 23.7 / 25.7, 37.1 / 34.9).
ONEDNN_NATIVE_MAX_ROWS_INTEL, ONEDNN_NATIVE_MAX_ROWS_INTEL_LARGE = 16, 8
ONEDNN_NATIVE_MAX_ROWS_AVX2 = 96
ONEDNN_NATIVE_MAX_ROWS_AVX2_WIDE = 64
WIDE_INPUT = 512
WIDE_INPUT_AVX512 = 1024


def onednn_native_max_rows(elements: int, K: int) -> int:
    """Up to how many rows an fp32 weight of `elements` with inputs K wide stays on the native
    GEMM when oneDNN is there."""
    if avx512() and cpu_vendor() == "GenuineIntel":
        return ONEDNN_NATIVE_MAX_ROWS_INTEL_LARGE if elements >= LARGE_WEIGHT \
            else ONEDNN_NATIVE_MAX_ROWS_INTEL
    if avx512():
        return ONEDNN_NATIVE_MAX_ROWS_WIDE if K > WIDE_INPUT_AVX512 else ONEDNN_NATIVE_MAX_ROWS
    if elements >= LARGE_WEIGHT or K > WIDE_INPUT:
        return ONEDNN_NATIVE_MAX_ROWS_AVX2_WIDE
    return ONEDNN_NATIVE_MAX_ROWS_AVX2


# bf16 / int8 weights without AMX: above these caps they are widened to fp32 for the GEMM, a
# pass over the whole weight per call. The native kernel widens in registers and is ahead of
# that up to ~64 rows on the projections (ms, in_proj 2816 x 768 bf16 at 32 / 64 / 128 rows:
# 0.49 / 0.93 / 1.70 native, 0.54 / 0.88 / 1.48 widened + oneDNN) and far longer on the
# lm_head (100k x 768 at 128 / 256 rows: bf16 65 / 146 against 148 / 209; int8 66 / 136
# against 237 / 288).
QUANTIZED_MAX_ROWS = 64
QUANTIZED_LARGE_MAX_ROWS = 512


# With AMX (amx_cpu.cpp) bf16 and int8 weights stay native at every row count: the tiles are
# ahead of widening + oneDNN fp32 at all sizes (bf16 2,048 x 2304 x 768: 239 GFLOP/s against
# oneDNN's 180 before its widening pass, 64 rows of the lm_head 49 ms against 130; int8, as
# exact bf16 panels, 64 rows of the lm_head 26 ms against 73-83 widened in registers).
AMX_MAX_ROWS = 1 << 40
# Up to this many rows (kDotBf16Rows in gemm_blocks.h) bf16 weights take the BF16 dot
# instructions where the build has them (isa.bf16_dots()): x split into two bf16 parts, as on
# AMX.
DOT_BF16_ROWS = 4


def dot_bf16() -> bool:
    """Whether bf16 weights' products of 1-DOT_BF16_ROWS rows run on the BF16 dots."""
    return isa.bf16_dots()


def bf16_split_rows(rows: int) -> bool:
    """Whether a bf16 (or, from AMX_FROM rows, int8) product of `rows` rows multiplies x
    split into bf16 parts (error <= 2^-17 |x| on top of fp32 sums), not x itself."""
    return (dot_bf16() and rows <= DOT_BF16_ROWS) or (amx() and rows >= AMX_FROM)


# Below this many rows (kAmxFrom in gemm_cpu.cpp) bf16 / int8 products stay in the AVX kernels,
# fp32 arithmetic on the weights; from it on they are the tiles' split-activation products.
AMX_FROM = 16


@functools.cache
def amx() -> bool:
    """Whether bf16 and int8 weights' products from a few rows on run on AMX tiles: the build
    has them (an Intel Sapphire Rapids or later host) and the kernel granted the process the
    tile state."""
    return available()[0] and library().linear_amx_ready() == 1


def linear_native_max_rows(weight: torch.Tensor) -> int:
    """Up to how many rows `linear_native` runs the native kernel for this weight (more go to
    oneDNN or sgemm)."""
    large = weight.numel() >= LARGE_WEIGHT
    if weight.dtype in (torch.bfloat16, torch.int8) and amx():
        return AMX_MAX_ROWS
    if weight.dtype != torch.float32:
        return QUANTIZED_LARGE_MAX_ROWS if large else QUANTIZED_MAX_ROWS
    if onednn_usable():
        return onednn_native_max_rows(weight.numel(), weight.shape[-1])
    return LARGE_WEIGHT_MAX_ROWS if large else LINEAR_NATIVE_MAX_ROWS


def linear_native(x: torch.Tensor, weight: torch.Tensor,
                  scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (`linear_ref`'s contract)."""
    # called ~50 times per decode step: checks kept to attribute reads (no generators), and a
    # 2-D contiguous x (every model projection's) neither reshaped nor its result viewed back
    # (those two cost ~5 of the ~16 us a small call took)
    K = x.shape[-1]
    flat = x.dim() == 2
    rows = x.shape[0] if flat else (x.numel() // K if K else 0)
    kernel = _WEIGHT_KERNELS.get(weight.dtype, ("", ""))[0]
    if not 0 < rows <= linear_native_max_rows(weight) or x.dtype != torch.float32 \
            or not kernel or not x.is_cpu or not weight.is_contiguous():
        # weight-only bf16 / int8 with many rows (prefill): widened for the GEMM, a pass
        # over the weight that a compute-bound product hides
        return gemm(x, dequantize(weight, scale, x.dtype))
    x2 = x if flat and x.is_contiguous() else x.reshape(rows, K).contiguous()
    N = weight.shape[0]
    y = torch.empty(rows, N, dtype=torch.float32)
    if weight.dtype == torch.int8:
        assert scale is not None, "int8 weights come with their row scales"
        s = scale.contiguous()
        library().linear_small_int8w(x2.data_ptr(), weight.data_ptr(), s.data_ptr(),
                                     y.data_ptr(), rows, N, K)
    else:
        getattr(library(), kernel)(x2.data_ptr(), weight.data_ptr(), y.data_ptr(), rows, N, K)
    return y if flat else y.view(*x.shape[:-1], N)

