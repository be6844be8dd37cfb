"""One Protocol per kernel op: the signature every backend of the op takes (shapes and meaning
in the `ref` backend, the oracle). `Kernels` holds one callable per op typed by these, so a
layer's call is checked against the op, whichever backend the registry picked; a feature's
parameter (`lower_bound`, `situ`) is passed by keyword. tests/unit/test_kernel_signatures.py
holds every registered backend to its op's Protocol."""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from kdaserve.kernels.ref.kda import Snapshots


class Linear(Protocol):
    def __call__(self, x: Tensor, weight: Tensor, scale: Tensor | None = None) -> Tensor: ...


class KdaChunk(Protocol):
    def __call__(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                 A_log: Tensor, dt_bias: Tensor, state: Tensor, state_slots: Tensor,
                 cu_seqlens: Tensor, snapshots: Snapshots | None = None, *,
                 lower_bound: float | None = None) -> Tensor: ...


class KdaRecurrent(Protocol):
    def __call__(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                 A_log: Tensor, dt_bias: Tensor, state: Tensor, state_slots: Tensor,
                 cu_seqlens: Tensor, *, lower_bound: float | None = None) -> Tensor: ...


class KdaDecode(Protocol):
    def __call__(self, qkv: Tensor, f: Tensor, beta: Tensor, z: Tensor, conv_weight: Tensor,
                 A_log: Tensor, dt_bias: Tensor, norm_weight: Tensor, eps: float,
                 state: Tensor, conv_state: Tensor, state_slots: Tensor,
                 cu_seqlens: Tensor | None = None, *,
                 lower_bound: float | None = None) -> Tensor: ...


class ShortConv(Protocol):
    def __call__(self, x: Tensor, weight: Tensor, conv_state: Tensor, state_slots: Tensor,
                 cu_seqlens: Tensor) -> Tensor: ...


class MlaAttention(Protocol):
    def __call__(self, q_nope: Tensor, q_pe: Tensor, kv_cache: Tensor, block_table: Tensor,
                 cu_seqlens: Tensor, context_lens: Tensor, w_uk: Tensor, w_uv: Tensor,
                 scale: float, max_seqlen: int = 0) -> Tensor: ...


class MoeRoute(Protocol):
    def __call__(self, logits: Tensor, bias: Tensor | None, top_k: int, num_group: int,
                 topk_group: int, renormalize: bool, scaling: float,
                 activation: str) -> tuple[Tensor, Tensor]: ...


class MoeExperts(Protocol):
    def __call__(self, x: Tensor, weights: Tensor, ids: Tensor, w13: Tensor, w2: Tensor,
                 scale13: Tensor | None = None, scale2: Tensor | None = None, *,
                 situ: tuple[float, float | None] | None = None) -> Tensor: ...


class RmsNorm(Protocol):
    def __call__(self, x: Tensor, weight: Tensor, eps: float) -> Tensor: ...


class GatedRmsNorm(Protocol):
    def __call__(self, o: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor: ...


class SiluMul(Protocol):
    def __call__(self, gate_up: Tensor) -> Tensor: ...


class SituMul(Protocol):
    def __call__(self, gate_up: Tensor, beta: float, linear_beta: float | None) -> Tensor: ...


class SigmoidMul(Protocol):
    def __call__(self, x: Tensor, gate: Tensor) -> Tensor: ...


class AttnResNorm(Protocol):
    def __call__(self, bank: Tensor, partial: Tensor, w_eff: Tensor, eps: float,
                 norm_weight: Tensor, norm_eps: float) -> Tensor: ...


class ImageAttention(Protocol):
    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


class GeluTanh(Protocol):
    def __call__(self, x: Tensor) -> Tensor: ...


class RopePairs(Protocol):
    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor: ...
