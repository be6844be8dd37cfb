"""A decode forward in one native call (kernels/native/csrc/decode_step.cpp).

On a CPU with the `native` kernels a small model's decode step spends a large part of its
time in Python between the kernels (the hidden-256 MoE: ~1.7 of 5 ms at batch 1). Where every
op of a decode batch would take the native kernel anyway, this runs the whole forward, from
the embedding to the final norm, as one C++ call that makes the same kernel calls in the same
order, so the hidden states equal the per-op forward's bit for bit (tested), and a context
drafter's taps come with them. A speculative verify (a few tokens per sequence, every row a
logits row) runs here too, its KDA step inputs written into the step's record for the
rollback, as the per-op forward's fused-step path keeps them. Anything else (prefill chunks,
routing capture, parallel ranks, other backends, dtypes or row counts the native kernels do
not take) runs the per-op forward.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import torch

from kdaserve.kernels.native import ops as native
from kdaserve.kernels.native.build import MAX_HEAD_DIM, available, library
from kdaserve.kernels.ref.mla import VERIFY_MAX_TOKENS
from kdaserve.kernels.registry import ONE_CALL_DECODE
from kdaserve.layers.attn_res import AttnResSite
from kdaserve.layers.kda import FUSED_MAX_TOKENS, KDAttention
from kdaserve.layers.linear import Linear
from kdaserve.layers.mla import LATENT_NORM_EPS
from kdaserve.layers.moe import MoE, situ_of

if TYPE_CHECKING:
    from kdaserve.cache.block_pool import BlockPool
    from kdaserve.cache.state_pool import StatePool
    from kdaserve.forward_batch import ForwardBatch
    from kdaserve.models.kimi_linear import KimiLinearForCausalLM

# decode_step.cpp's `Layer`: 92 int64 fields, 4 doubles, then K3's 20 int64 and 4 doubles;
# `Model`: 5 int64, 1 double, then K3's 3 int64 and 1 double
_LAYER = struct.Struct("<92q4d20q4d")
_MODEL = struct.Struct("<5qd3qd")
_WEIGHT_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
_EXPERT_CODES = {**_WEIGHT_CODES, torch.uint8: 3}  # uint8: MXFP4 (kernels/ref/mxfp4.py)
_NONE = (0, 0, 0, 0, 0)  # an absent projection
# the ops decode_step.cpp calls: their backends must say they are the calls it makes
DECODE_OPS = ("linear", "kda_decode", "mla_attention", "moe_route", "moe_experts", "rms_norm",
              "silu_mul", "situ_mul", "sigmoid_mul", "attn_res_norm")
_MAX_SOURCES = 64  # the AttnRes kernel's bank rows + 1 (csrc/elementwise_cpu.cpp)
# new tokens per sequence up to which the per-op forward runs KDA's fused step token by token
# and MLA's verify kernel (layers/kda.py, kernels/native/ops.py), the calls this one makes
_FEW_TOKENS = min(FUSED_MAX_TOKENS, VERIFY_MAX_TOKENS)


class Unsupported(Exception):
    """The model as it is now (dtypes, layout) has no native decode forward."""


def _f32(t: torch.Tensor) -> int:
    if t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous():
        raise Unsupported
    return t.data_ptr()


def _contiguous(t: torch.Tensor | None) -> int:
    if t is None or not t.is_cpu or not t.is_contiguous():
        raise Unsupported
    return t.data_ptr()


def _linear(lin: Linear, caps: list[int]) -> tuple[int, int, int, int, int]:
    w = lin.weight
    code = _WEIGHT_CODES.get(w.dtype)
    if code is None or not w.is_cpu or not w.is_contiguous() \
            or (code == 2) != (lin.scale is not None):
        raise Unsupported
    caps.append(native.linear_native_max_rows(w))
    scale = 0 if lin.scale is None else _f32(lin.scale)
    return (w.data_ptr(), code, scale, w.shape[0], w.shape[1])


class NativeDecode:
    """The one-call decode forward of `model`, or None from `for_model` where its kernels are
    not all the native ones or its layers have no native path."""

    def __init__(self, model: KimiLinearForCausalLM) -> None:
        self.model = model
        self._key: tuple[int, ...] | None = None  # the pools' addresses the plan holds
        # model, layers, most rows; or Unsupported, the layout refused (asked once)
        self._plan: tuple[bytes, bytes, int] | Unsupported | None = None
        # (heads, head width) of each KDA layer in order: a verify's record entries
        self._kda = [(layer.self_attn.num_heads, layer.self_attn.head_dim)
                     for layer in model.layers if isinstance(layer.self_attn, KDAttention)]

    @classmethod
    def for_model(cls, model: KimiLinearForCausalLM) -> NativeDecode | None:
        c = model.config
        if not model.kernels.have(ONE_CALL_DECODE, DECODE_OPS) or not available()[0] \
                or model.tp.size > 1 or model.ep.size > 1 or (
                    c.attn_res_block_size and -(-c.num_hidden_layers // c.attn_res_block_size)
                    + 1 > _MAX_SOURCES):
            return None
        for layer in model.layers:
            attn = layer.self_attn
            if isinstance(attn, KDAttention) and attn.head_dim > MAX_HEAD_DIM:
                return None
        return cls(model)

    def takes(self, batch: ForwardBatch) -> bool:
        """Whether this batch is one this forward runs (the plan is checked at the call): a
        decode batch, or sequences of a few new tokens each, all of them logits rows (a
        verify), where the per-op forward runs KDA's fused step and MLA's verify kernel."""
        return (batch.is_decode or 0 < batch.max_seqlen <= _FEW_TOKENS) \
            and batch.routing is None and batch.snapshots is None \
            and batch.embed_rows is None \
            and batch.logits_indices.shape[0] == batch.input_ids.shape[0]

    def __call__(self, batch: ForwardBatch, states: StatePool,
                 blocks: BlockPool) -> torch.Tensor | None:
        """Final-normed hidden states [B, D] of the batch's B rows, or None where the native
        path does not apply now (the caller runs the per-op forward)."""
        try:
            model_bytes, layer_bytes, most_rows = self._current_plan(states, blocks)
        except Unsupported:
            return None
        B = batch.input_ids.shape[0]
        if not 0 < B <= most_rows:
            return None
        i64 = torch.int64
        ids = batch.input_ids.to(i64).contiguous()
        slots = batch.state_slots.to(i64).contiguous()
        table = batch.block_table.to(i64).contiguous()
        lens = batch.context_lens.to(i64).contiguous()
        cu = batch.cu_seqlens.to(i64).contiguous()
        mapping = batch.slot_mapping.to(i64).contiguous()
        D = self.model.config.hidden_size
        out = torch.empty(B, D, dtype=torch.float32)
        # a drafter's taps: every row this takes is a logits row, so tap_all_rows or
        # not, every row (K3's aggregated stream: the next site's mix, models/kimi_linear.py)
        taps = tapped = None  # a plain step allocates neither (the hot path)
        if batch.taps:
            taps = torch.tensor(batch.taps, dtype=i64)
            tapped = torch.empty(B, len(batch.taps) * D, dtype=torch.float32)
        # a verify's record: each KDA layer's pre-conv q|k|v, raw gate and beta logits, as the
        # per-op forward hands them to StepRecord.add (written by the C++, never read there)
        record: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        pointers = None
        if batch.record is not None:
            f32 = torch.float32
            record = [(torch.empty(B, 3 * H * K, dtype=f32), torch.empty(B, H, K, dtype=f32),
                       torch.empty(B, H, dtype=f32)) for H, K in self._kda]
            pointers = torch.tensor([t.data_ptr() for steps in record for t in steps],
                                    dtype=i64)
        library().decode_forward_f32(model_bytes, layer_bytes, ids.data_ptr(), slots.data_ptr(),
                                     table.data_ptr(), table.shape[1], lens.data_ptr(),
                                     cu.data_ptr(), mapping.data_ptr(), out.data_ptr(), B,
                                     cu.shape[0] - 1,
                                     0 if taps is None else taps.data_ptr(), len(batch.taps),
                                     int(batch.tap_stream == "aggregated"),
                                     0 if tapped is None else tapped.data_ptr(),
                                     0 if pointers is None else pointers.data_ptr())
        if tapped is not None:
            batch.tapped = tapped
        for steps in record:  # every KDA layer's, in order (the per-op forward's `add`)
            batch.record.add(*steps)
        return out

    def most_rows(self) -> int:
        """The largest decode batch the current plan runs (the native kernels' row caps)."""
        return self._plan[2] if isinstance(self._plan, tuple) else 0

    def invalidate(self) -> None:
        """The model's weight tensors may have new storage (RL's release, resume or weight
        update: `ModelRunner.weights_replaced`, which whatever replaces them must call): the
        next call plans again."""
        self._plan = None

    def _current_plan(self, states: StatePool, blocks: BlockPool) -> tuple[bytes, bytes, int]:
        """The packed plan for the weights and pools as they are now: rebuilt after
        `invalidate` and when a pool was replaced (a release and resume allocates anew).
        Checking every parameter's address each call instead cost 18-22 us a step (~7% of a
        k3-tiny decode step)."""
        key = (states.recurrent.data_ptr(), states.conv.data_ptr(), blocks.kv.data_ptr())
        if key != self._key or self._plan is None:
            self._key = key
            try:
                self._plan = self._build(states, blocks)
            except Unsupported as e:
                self._plan = e
        if isinstance(self._plan, Unsupported):
            raise self._plan
        return self._plan

    def _build(self, states: StatePool, blocks: BlockPool) -> tuple[bytes, bytes, int]:
        m, c = self.model, self.model.config
        caps: list[int] = []
        layers = []
        expert_dtype = torch.float32  # the routed experts' weights (a dense model has none)
        situ = situ_of(c)
        act = (situ[0], situ[1] or 0.0) if situ else (0.0, 0.0)  # as the kernels are called
        for i, layer in enumerate(m.layers):
            j = m.cache_index[i]
            attn, mlp = layer.self_attn, layer.mlp
            f: list[int] = [int(layer.is_kda), int(layer.is_moe),
                            _f32(layer.input_layernorm.weight),
                            _f32(layer.post_attention_layernorm.weight)]
            kda_eps = mla_scale = latent_eps = lower_bound = 0.0
            q_lora: list[int] = [*_NONE, *_NONE, 0]
            mla_gate = _NONE
            if isinstance(attn, KDAttention):
                f += [*_linear(attn.in_proj, caps), *_linear(attn.f_b_proj, caps),
                      *(_NONE if attn.g_b_proj is None else _linear(attn.g_b_proj, caps)),
                      *_linear(attn.o_proj, caps)]
                f += [_f32(attn.conv_weight), _f32(attn.A_log), _f32(attn.dt_bias),
                      _f32(attn.o_norm_weight), _f32(states.recurrent[j]), _f32(states.conv[j]),
                      attn.num_heads, attn.head_dim, attn.conv_weight.shape[1]]
                f += [*_NONE] * 3 + [0] * 9
                kda_eps = attn.eps
                lower_bound = c.kda_gate_lower_bound or 0.0
            else:
                f += [*_NONE] * 4 + [0] * 9
                if attn.use_q_lora:
                    q_lora = [*_linear(attn.q_a_proj, caps), *_linear(attn.q_b_proj, caps),
                              _f32(attn.q_a_layernorm.weight)]
                f += [*(_NONE if attn.use_q_lora else _linear(attn.q_proj, caps)),
                      *_linear(attn.kv_a_proj_with_mqa, caps), *_linear(attn.o_proj, caps)]
                kv = blocks.kv[j]
                f += [_f32(attn.kv_a_layernorm.weight), _f32(attn.kv_b_proj.weight), _f32(kv),
                      attn.num_heads, attn.dn, attn.dr, attn.dv, attn.rank, kv.shape[1]]
                mla_scale, latent_eps = attn.scale, LATENT_NORM_EPS
                if attn.g_proj is not None:
                    mla_gate = _linear(attn.g_proj, caps)
            latent: list[int] = [*_NONE, *_NONE, 0]
            lat_eps = 0.0
            if isinstance(mlp, MoE):
                f += self._moe(mlp, caps)
                expert_dtype = mlp.w13.dtype
                if mlp.down_proj is not None:
                    assert mlp.up_proj is not None
                    norm = mlp.latent_norm
                    latent = [*_linear(mlp.down_proj, caps), *_linear(mlp.up_proj, caps),
                              0 if norm is None else _f32(norm.weight)]
                    lat_eps = 0.0 if norm is None else norm.eps
            else:
                f += [*_linear(mlp.gate_up_proj, caps), *_linear(mlp.down_proj, caps)]
                f += [0] * 14
            routed = c.routed_scaling_factor if isinstance(mlp, MoE) else 0.0
            sites = [0] * 4
            if layer.attn_res is not None and layer.mlp_res is not None:
                sites = [*self._site(layer.attn_res), *self._site(layer.mlp_res)]
            layers.append(_LAYER.pack(*f, *q_lora, kda_eps, mla_scale, latent_eps, routed,
                                      *mla_gate, *latent, *sites, lower_bound, *act, lat_eps))
        block, out_site = 0, [0, 0]
        if m.output_attn_res is not None:
            block = c.attn_res_block_size or 0
            out_site = self._site(m.output_attn_res)
        head = _MODEL.pack(len(m.layers), c.hidden_size, _f32(m.embed_tokens.weight),
                           _f32(m.norm.weight), native.moe_blocked_from(expert_dtype),
                           c.rms_norm_eps, block, *out_site, c.rms_norm_eps)
        return head, b"".join(layers), min(caps)

    @staticmethod
    def _moe(mlp: MoE, caps: list[int]) -> list[int]:
        """A MoE layer's shared expert, router and routed experts, as `Layer` lays them out."""
        c = mlp.config
        if mlp.shared_slot is not None:  # the C++ routes over the routed experts only
            raise Unsupported
        shared = mlp.shared_experts
        f = [*_linear(shared.gate_up_proj, caps), *_linear(shared.down_proj, caps)] \
            if shared is not None else [*_NONE] * 2
        w13, w2 = mlp.w13, mlp.w2
        code = _EXPERT_CODES.get(w13.dtype)
        if code is None or w2.dtype != w13.dtype or not w13.is_contiguous() \
                or not w2.is_contiguous() or (code >= 2) != (mlp.w13_scale is not None):
            raise Unsupported
        if code == 3:  # MXFP4: E8M0 scales, two codes a byte along the intermediate rows
            s13, s2 = _contiguous(mlp.w13_scale), _contiguous(mlp.w2_scale)
            inter = w2.shape[-1] * 2
        else:
            s13 = 0 if mlp.w13_scale is None else _f32(mlp.w13_scale)
            s2 = 0 if mlp.w2_scale is None else _f32(mlp.w2_scale)
            inter = w2.shape[-1]
        bias = mlp.e_score_correction_bias
        if c.router_activation not in ("sigmoid", "softmax"):
            raise Unsupported
        caps.append(native.linear_native_max_rows(mlp.gate_weight))
        return f + [_f32(mlp.gate_weight), 0 if bias is None else _f32(bias), w13.data_ptr(),
                    w2.data_ptr(), code, s13, s2, c.num_experts, inter,
                    c.num_experts_per_token, c.num_expert_group, c.topk_group,
                    int(c.moe_renormalize), int(c.router_activation == "sigmoid")]

    def _site(self, site: AttnResSite) -> list[int]:
        """An AttnRes site's norm and projection weights (the C++ multiplies them each step)."""
        if site.eps != self.model.config.rms_norm_eps:
            raise Unsupported  # the plan carries one epsilon for every site
        return [_f32(site.norm_weight), _f32(site.proj_weight)]
