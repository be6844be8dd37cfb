"""Fused MoE experts in Triton: `moe_experts_ref`'s contract in two grouped GEMMs.

The routed (token, slot) pairs are sorted by expert and each expert's run is padded to a
multiple of BLOCK_M (`align_by_expert`), so that every block of BLOCK_M sorted rows belongs to
one expert. Then:
    1. gate_up: per block, the rows' x against that expert's W1 and W3 at once (two fp32
       accumulators over the same loads of x), SiLU(W1 x) * W3 x written per sorted row;
    2. down: per block, the SwiGLU rows against the expert's W2, scaled by the routing weight
       and written to the pair's own row of a [T * k, D] buffer, summed over k at the end.
No atomics: the sum over a token's experts is one ordered reduction, so the output does not
depend on the blocks' scheduling. The padded row count has a fixed bound (T * k + E * (BLOCK_M
- 1)), unused blocks carry expert -1 and exit: the launch shape depends on T alone, as a CUDA
graph needs. Weight-only int8 (per-row scales) is widened in the kernel after the load;
MXFP4 experts (uint8 codes and E8M0 scales, kernels/ref/mxfp4.py) are decoded in the K loop,
each tile from its 4-bit codes and group scales, and multiplied in the activations' dtype
(W4A16: the packed weights are what a step reads).

Triton is imported on the first call (`_kernels`), never at import: on CPU the suite runs
these kernels under the interpreter (TRITON_INTERPRET=1) in a process of its own.
"""

from __future__ import annotations

from typing import Any

import torch

from kdaserve.kernels.triton import jit_module, tile

BLOCK_M = 16  # sorted rows per block: tl.dot's least M on tensor cores


def align_by_expert(ids: torch.Tensor, num_experts: int,
                    block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (sorted_pairs [P], block_expert [P / block_m]). sorted_pairs holds pair
    indices t * k + slot grouped by expert, each expert's run padded to a multiple of block_m
    with T * k (no pair); block_expert is each block's expert, -1 past the used blocks. P is
    the bound T * k + E * (block_m - 1), rounded up to block_m."""
    # every shape here depends on T alone and no op reads a value back to the host (no
    # bincount, no repeat_interleave by counts): the alignment can sit inside a CUDA graph
    flat = ids.flatten().to(torch.int64)
    n, dev = flat.numel(), ids.device
    num_blocks = -(-(n + num_experts * (block_m - 1)) // block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)  # one past each expert's last sorted row
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    first = torch.cumsum(counts, 0) - counts  # each expert's first pair in `order`
    dest = ends[experts] - padded[experts] + torch.arange(n, device=dev) - first[experts]
    sorted_pairs = torch.full((num_blocks * block_m,), n, dtype=torch.int64, device=dev)
    sorted_pairs[dest] = order
    # a block's expert: the first whose run ends past the block's first row
    block_expert = torch.searchsorted(
        ends, torch.arange(num_blocks, device=dev) * block_m, right=True)
    return sorted_pairs, torch.where(block_expert < num_experts, block_expert, -1)


def _kernels() -> Any:
    return jit_module("moe_kernels")


def route_block_t(num_group: int) -> int:
    """Tokens per routing program: 8 for grouped routing, whose group scores and masks
    beside the [tokens, experts] tiles spilled registers at 16 (sm_90, 256 experts in 8
    groups: 40 bytes of stack; check_sm90.py), 16 otherwise."""
    return 8 if num_group > 1 else 16


def moe_route_triton(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                     num_group: int, topk_group: int, renormalize: bool, scaling: float,
                     activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_route_ref`'s contract in one kernel, grouped or not (Kimi's num_group 1;
    DeepSeek-V3's group-limited choice where num_group > 1): logits [T, E] -> (fp32 weights
    [T, k], int64 ids [T, k]), ids in descending choice."""
    T, E = logits.shape
    if num_group > 1 and (E % num_group or not 0 < topk_group <= num_group):
        raise ValueError(f"{E} experts do not split into {num_group} groups with "
                         f"{topk_group} kept")
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, ids
    block_t = route_block_t(num_group)
    _kernels().route_kernel[(-(-T // block_t),)](
        logits.contiguous(), bias.float().contiguous() if bias is not None else logits,
        weights, ids, T, E, scaling, HAS_BIAS=bias is not None,
        SIGMOID=activation == "sigmoid", RENORMALIZE=renormalize, TOP_K=top_k,
        NUM_GROUP=max(num_group, 1), TOPK_GROUP=topk_group, BLOCK_T=block_t,
        BLOCK_E=tile(E), BLOCK_K=tile(top_k), BLOCK_G=tile(max(num_group, 1), least=2))
    return weights, ids


def moe_experts_triton(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                       w13: torch.Tensor, w2: torch.Tensor, scale13: torch.Tensor | None = None,
                       scale2: torch.Tensor | None = None,
                       situ: tuple[float, float | None] | None = None) -> torch.Tensor:
    """`moe_experts_ref`'s contract: x [T, D]; weights, ids [T, k]; w13 [E, 2I, D] (gate rows
    then up rows); w2 [E, D, I]; int8 weights with per-row scales [E, 2I] / [E, D]; MXFP4
    (uint8) w13 [E, 2I, D / 2] and w2 [E, D, I / 2] with E8M0 scales [E, 2I, D / 32] and
    [E, D, I / 32]. fp32
    inputs multiply in IEEE fp32 (no TF32), bf16 ones in bf16; both accumulate in fp32.
    `situ`: K3's SiTU-GLU in the gate_up kernel, each pair's weighted row kept in fp32 and
    summed over the token's experts in fp32."""
    kernels = _kernels()
    T, D = x.shape
    E, two_i, _ = w13.shape
    inter, top_k = two_i // 2, ids.shape[1]
    mxfp4 = w13.dtype == torch.uint8
    if T == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    pairs, block_expert = align_by_expert(ids, E)
    h = torch.empty(pairs.numel(), inter, dtype=x.dtype, device=x.device)
    out = torch.zeros(T * top_k, D, dtype=torch.float32 if situ else x.dtype, device=x.device)
    beta, linear_beta = situ if situ else (1.0, None)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    if (scale13 is None) != (scale2 is None) or (mxfp4 and scale13 is None):
        raise ValueError("int8 and MXFP4 experts need both scale13 and scale2")
    has_scale = scale13 is not None and not mxfp4  # int8's rows scaled after the product
    if mxfp4:
        scale13, scale2 = scale13.contiguous(), scale2.contiguous()
    elif has_scale:
        scale13, scale2 = scale13.float().contiguous(), scale2.float().contiguous()
    tile_d, tile_i = tile(D, most=64), tile(inter, most=64)
    kernels.gate_up_kernel[(block_expert.numel(), -(-inter // tile_i))](
        x, w13, scale13 if scale13 is not None else x, pairs, block_expert, h, T * top_k, top_k,
        D, inter, beta, linear_beta or 1.0, HAS_SCALE=has_scale, SITU=situ is not None,
        CAP_UP=linear_beta is not None, BLOCK_M=BLOCK_M, BLOCK_N=tile_i, BLOCK_K=tile_d,
        PRECISION=precision, MXFP4=mxfp4,
        num_warps=8)  # two weight tiles' addresses: with 4 warps they spilled (check_sm90.py)
    kernels.down_kernel[(block_expert.numel(), -(-D // tile_d))](
        h, w2, scale2 if scale2 is not None else x, pairs, block_expert,
        weights.to(torch.float32).contiguous(), out, T * top_k, D, inter,
        HAS_SCALE=has_scale, BLOCK_M=BLOCK_M, BLOCK_N=tile_d, BLOCK_K=tile_i, PRECISION=precision,
        MXFP4=mxfp4)
    return out.view(T, top_k, D).sum(1).to(x.dtype)
