"""Run by tests/kernels/test_triton_interpreted.py under Triton's interpreter: the decode
forward a CUDA graph captures (engine/cuda_graph.py's static buffers, padded to a bucket) on
our Triton kernels reads no value back to the host and sizes no tensor by data, the two
things a capture cannot hold, and its logits equal the eager forward's.

The KDA step is the triton backend's own (K3's too: its gate, SiTU in the experts and the
dense layer, the AttnRes mix + norm): `kda_decode_triton`, our fused kernel (fla is
needed only for prefill chunks, which a graph never runs). The MoE runs its shared expert
inside the fused experts kernel, as the triton backend does; the reference keeps it apart.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kdaserve.cache.block_pool import BlockPool
from kdaserve.cache.state_pool import StatePool
from kdaserve.checkpoint import make_checkpoint
from kdaserve.config import ModelConfig
from kdaserve.engine.cuda_graph import CudaGraphRunner, GraphKey
from kdaserve.forward_batch import ForwardBatch
from kdaserve.kernels import Kernels, linear_ref
from kdaserve.kernels.cpu.decode import kda_recurrent_cpu
from kdaserve.kernels.ref.attn_res import attn_res_norm_ref
from kdaserve.kernels.ref.kda import (
    compose_kda_decode,
    gated_rmsnorm,
    kda_chunk_ref,
    kda_recurrent_ref,
    short_conv_ref,
)
from kdaserve.kernels.ref.mla import mla_attention_ref
from kdaserve.kernels.ref.mlp import sigmoid_mul_ref, silu_mul_ref, situ_mul_ref
from kdaserve.kernels.ref.moe import moe_experts_ref, moe_route_ref
from kdaserve.kernels.ref.norm import rms_norm_ref
from kdaserve.kernels.triton.k3 import attn_res_norm_triton, situ_mul_triton
from kdaserve.kernels.triton.kda import kda_decode_triton
from kdaserve.kernels.triton.mla import mla_attention_triton
from kdaserve.kernels.triton.moe import moe_experts_triton, moe_route_triton
from kdaserve.models.loader import build_model
from kdaserve.step_record import StepRecord

aten = torch.ops.aten
# ops that read a tensor's value on the host (.item(), bool(), int()) or size their output by
# data (nonzero, masked_select, unique, repeat_interleave by counts), or take host data in
# (torch.tensor of a list)
HOST_READS = {aten._local_scalar_dense.default, aten.nonzero.default,
              aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
              aten.unique_consecutive.default, aten.repeat_interleave.Tensor,
              aten.lift_fresh.default}


class NoHostReads(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func in HOST_READS:
            raise AssertionError(f"{func} inside a captured forward")
        if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
            idx = args[1]
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx if i
                   is not None):
                raise AssertionError(f"{func} with a boolean mask inside a captured forward")
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    def refuse(self: torch.Tensor) -> None:
        raise AssertionError("Tensor.tolist inside a captured forward")

    saved = torch.Tensor.tolist
    torch.Tensor.tolist = refuse  # type: ignore[method-assign] - not a dispatched op
    try:
        with NoHostReads():
            yield
    finally:
        torch.Tensor.tolist = saved  # type: ignore[method-assign]


def build(path: Path, triton: bool) -> tuple:
    config = ModelConfig.from_pretrained(path)
    decode = kda_decode_triton if triton else functools.partial(
        compose_kda_decode, short_conv_ref, kda_recurrent_cpu)
    kernels = Kernels(linear_ref, kda_chunk_ref, kda_recurrent_ref, decode, short_conv_ref,
                      mla_attention_triton if triton else mla_attention_ref,
                      moe_route_triton if triton else moe_route_ref,
                      moe_experts_triton if triton else moe_experts_ref, rms_norm_ref,
                      gated_rmsnorm, silu_mul_ref, situ_mul_triton if triton else situ_mul_ref,
                      sigmoid_mul_ref, attn_res_norm_triton if triton else attn_res_norm_ref,
                      fuse_shared_expert=triton, features=config.kernel_features)
    model = build_model(config, kernels, torch.float32, torch.device("cpu"), path)
    return model, BlockPool(config, 32, 4, torch.float32), StatePool(config, 6, torch.float32)


# small: 4 expert groups, a q LoRA; k3-tiny: K3's gate, SiTU, LatentMoE, AttnRes
@pytest.mark.parametrize("preset", ["tiny", "small", "k3-tiny"])
def test_captured_decode_reads_nothing_back(tmp_path: Path, preset: str) -> None:
    path = make_checkpoint(tmp_path / preset, preset, seed=0)
    prompts = [[(5 * i + 3 * j) % 700 + 2 for j in range(3 + 4 * i)] for i in range(3)]
    logits = {}
    for triton in (True, False):
        model, blocks, states = build(path, triton)
        slots = [states.allocate() for _ in prompts]
        tables = [blocks.allocate(blocks.blocks_needed(len(p) + 1)) for p in prompts]
        runner = CudaGraphRunner(model, states, blocks, 4, 64, capture=False)
        with torch.inference_mode():
            for s, t, p in zip(slots, tables, prompts, strict=True):
                model.forward(ForwardBatch.build([p], [0], [s], [t], blocks.block_size),
                              states, blocks)
            fb = ForwardBatch.build([[7], [8], [9]], [len(p) for p in prompts], slots,
                                    tables, blocks.block_size)
            runner.load(fb, 1)
        if triton:
            # under no_grad, not inference_mode: in inference mode a scalar read skips the
            # Python dispatch mode and would go unseen
            key = GraphKey(4, 1, None)
            with torch.no_grad(), no_host_reads():
                runner.forward(key, runner.view(key))
            logits[triton] = runner.logits[:3].clone()
        else:  # the reference kernels, eagerly, unpadded
            with torch.inference_mode():
                logits[triton] = model.forward(fb, states, blocks)
    torch.testing.assert_close(logits[True], logits[False], atol=2e-4, rtol=2e-4)


def test_captured_verify_reads_nothing_back(tmp_path: Path) -> None:
    """A verify step (3 sequences, 1 + 2 tokens each, padded to 4 sequences) as a graph holds
    it: no host read (the MLA kernel told it is a verify by max_seqlen), and its logits and
    KDA step record equal the reference's eager verify."""
    path = make_checkpoint(tmp_path / "tiny", "tiny", seed=0)
    prompts = [[(5 * i + 3 * j) % 700 + 2 for j in range(3 + 4 * i)] for i in range(3)]
    drafts = [[7, 8, 9], [10, 11, 12], [13, 14, 15]]
    out = {}
    for triton in (True, False):
        model, blocks, states = build(path, triton)
        slots = [states.allocate() for _ in prompts]
        tables = [blocks.allocate(blocks.blocks_needed(len(p) + 3)) for p in prompts]
        runner = CudaGraphRunner(model, states, blocks, 4, 64, max_q=3, capture=False)
        with torch.inference_mode():
            for s, t, p in zip(slots, tables, prompts, strict=True):
                model.forward(ForwardBatch.build([p], [0], [s], [t], blocks.block_size),
                              states, blocks)
        fb = ForwardBatch.build(drafts, [len(p) for p in prompts], slots, tables,
                                blocks.block_size, num_logits=[3, 3, 3])
        fb.record = StepRecord(list(range(9)), {}, "cpu")
        if triton:
            key = runner.key(fb)
            assert key == GraphKey(4, 3, None)
            with torch.inference_mode():
                runner.load(fb, 3)
            view = runner.view(key)  # built before a capture, as _capture does
            with torch.no_grad(), no_host_reads():
                runner.forward(key, view)
            logits = runner.logits[:9].clone()
            record = [[x[:9].clone() for x in steps] for steps in runner.record]
        else:
            with torch.inference_mode():
                logits = model.forward(fb, states, blocks)
            record = [list(steps) for steps in fb.record.layers]
        out[triton] = logits, record, states.recurrent[:, slots].clone()
    torch.testing.assert_close(out[True][0], out[False][0], atol=2e-4, rtol=2e-4)
    assert len(out[True][1]) == len(out[False][1]) > 0
    for a, b in zip(out[True][1], out[False][1], strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[True][2], out[False][2], atol=2e-4, rtol=2e-4)


def test_the_guard_sees_host_reads() -> None:
    x = torch.arange(4)
    for read in (lambda: x.max().item(), lambda: int(x.sum()), lambda: x.nonzero(),
                 lambda: x[x > 1], lambda: x.tolist(), lambda: torch.tensor([1, 2])):
        with contextlib.suppress(AssertionError), no_host_reads():
            read()
            raise RuntimeError("a host read went unseen")
