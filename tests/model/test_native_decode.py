"""The one-call native decode forward (engine/native_decode.py, csrc/decode_step.cpp) equals
the per-op forward bit for bit (hidden states, KDA states, conv windows, latent cache), is the
path decode steps take where it applies, and steps aside where it does not."""

from __future__ import annotations

import copy
import dataclasses
import struct
from pathlib import Path

import pytest
import torch

from kdaserve import LLM, RequestOptions, SamplingParams
from kdaserve.engine.native_decode import NativeDecode
from kdaserve.forward_batch import ForwardBatch
from kdaserve.kernels import use_backend
from kdaserve.step_record import StepRecord


class Checked:
    """Stands in for the model's NativeDecode: runs the per-op forward on copies of the pools
    first, then the native one on the real pools, and asserts they agree exactly."""

    def __init__(self, llm: LLM) -> None:
        self.model, self.runner = llm.model, llm.engine.runner
        self.native = self.runner.native_decode
        assert self.native is not None
        self.calls = self.skipped = 0

    def takes(self, batch) -> bool:  # noqa: ANN001
        return self.native.takes(batch)

    def __call__(self, batch, states, blocks):  # noqa: ANN001, ANN204
        s2, b2 = copy.copy(states), copy.copy(blocks)
        s2.recurrent, s2.conv, b2.kv = states.recurrent.clone(), states.conv.clone(), \
            blocks.kv.clone()
        want = self.model.forward_hidden(batch, s2, b2)  # the per-op forward
        got = self.native(batch, states, blocks)
        if got is None:  # only above the native kernels' row caps (4 rows on AVX-512 hosts)
            assert batch.input_ids.shape[0] > self.native.most_rows()
            self.skipped += 1
            return want
        self.calls += 1
        assert torch.equal(got, want)
        assert torch.equal(states.recurrent, s2.recurrent)
        assert torch.equal(states.conv, s2.conv)
        assert torch.equal(blocks.kv, b2.kv)
        return got


def decode(llm: LLM, batch: int, steps: int = 4, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 3800, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 40, (batch,), generator=g)]
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


@pytest.mark.parametrize("options", [{}, {"dtype": "bfloat16"}, {"quantization": "int8"}],
                         ids=["fp32", "bf16-weights", "int8-weights"])
def test_native_decode_equals_per_op_forward(tiny_ckpt: Path, small_ckpt: Path,
                                             options: dict) -> None:
    """tiny (bf16 on disk, no q LoRA, one expert group) and small (q LoRA, grouped routing),
    batches of 1, 3 and 16 sequences, every step compared."""
    for ckpt in (tiny_ckpt, small_ckpt):
        llm = LLM(ckpt, **options)
        checked = Checked(llm)
        llm.engine.runner.native_decode = checked
        for B in (1, 3, 16):
            decode(llm, B, seed=B)
        assert checked.calls + checked.skipped == 3 * 3  # (steps - 1) decodes per batch size
        assert checked.calls >= 3  # batch 1 is always native


@pytest.mark.parametrize("options", [{}, {"dtype": "bfloat16"}, {"quantization": "int8"}],
                         ids=["fp32", "bf16-weights", "int8-weights"])
def test_native_decode_runs_k3(k3_ckpt: Path, k3_mxfp4_ckpt: Path, options: dict) -> None:
    """K3 (Attention Residuals across block boundaries, the lower-bounded KDA gate with its
    full-rank output gate, gated q-LoRA MLA, LatentMoE and SiTU-GLU; k3-small's experts as
    MXFP4) equals its per-op forward bit for bit, batch 1 and 3."""
    for ckpt in (k3_ckpt, k3_mxfp4_ckpt):
        llm = LLM(ckpt, **options)
        checked = Checked(llm)
        llm.engine.runner.native_decode = checked
        for B in (1, 3):
            decode(llm, B, seed=B)
        assert checked.calls + checked.skipped == 2 * 3
        assert checked.calls >= 3


def test_native_decode_steps_aside(tiny_ckpt: Path) -> None:
    """Other backends get no native forward; prefill chunks, verify records, routing capture
    and snapshots run the per-op forward (a drafter's taps do not: the native forward takes
    them)."""
    with use_backend("cpu"):
        assert LLM(tiny_ckpt).engine.runner.native_decode is None
    llm = LLM(tiny_ckpt)
    native = llm.engine.runner.native_decode
    assert isinstance(native, NativeDecode)
    asked: list[bool] = []
    real = native.takes
    native.takes = lambda batch: asked.append(real(batch)) or asked[-1]  # type: ignore
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params,
                 options=RequestOptions(return_routed_experts=True))
    assert asked == [False, False, False]  # the prefill, then two decodes with routing
    asked.clear()
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params)
    assert asked == [False, True, True]
    decode_batch = ForwardBatch.build([[5], [6]], [3, 4], [0, 1], [[0], [1]], 16)
    assert native.takes(decode_batch)
    assert native.takes(dataclasses.replace(decode_batch, taps=(1,)))  # taps come with it
    for change in ({"routing": []}, {"record": StepRecord([0, 1], {}, "cpu")},
                   {"snapshots": (torch.zeros(1, dtype=torch.int64),) * 3}):
        assert not native.takes(dataclasses.replace(decode_batch, **change))


class TapChecked(Checked):
    """Checked, with a drafter's taps asked of every decode batch: the native forward's tapped
    rows equal the per-op forward's (the partial sum and the residual stream are copies, bit
    for bit; K3's aggregated stream is the next site's mix, computed by the native kernel
    where the per-op path runs kernels/ref/attn_res.py's)."""

    def __init__(self, llm: LLM, stream: str) -> None:
        super().__init__(llm)
        L = llm.engine.model_config.num_hidden_layers
        self.taps, self.stream = (0, L // 2, L - 1), stream
        self.tapped = 0

    def __call__(self, batch, states, blocks):  # noqa: ANN001, ANN204
        asked = dataclasses.replace(batch, taps=self.taps, tap_stream=self.stream,
                                    tap_all_rows=True, tapped=None)
        s2, b2 = copy.copy(states), copy.copy(blocks)
        s2.recurrent, s2.conv, b2.kv = states.recurrent.clone(), states.conv.clone(), \
            blocks.kv.clone()
        want = self.model.forward_hidden(asked, s2, b2)
        want_taps, asked.tapped = asked.tapped, None
        got = self.native(asked, states, blocks)
        assert got is not None and torch.equal(got, want)
        assert want_taps is not None and asked.tapped is not None
        if self.stream == "aggregated" and self.model.config.attn_res_block_size:
            torch.testing.assert_close(asked.tapped, want_taps, atol=1e-5, rtol=1e-5)
        else:
            assert torch.equal(asked.tapped, want_taps)
        self.tapped += 1
        return got


@pytest.mark.parametrize("stream", ["partial", "aggregated"])
def test_native_decode_taps_equal_the_per_op_forwards(tiny_ckpt: Path, k3_ckpt: Path,
                                                      stream: str) -> None:
    """A context drafter's taps (K3's partial and aggregated streams, Kimi Linear's residual
    stream) come out of the one-call forward as the per-op forward computes them, batch 1
    and 3; the hidden states stay bit-equal."""
    for ckpt in (tiny_ckpt, k3_ckpt):
        llm = LLM(ckpt)
        checked = TapChecked(llm, stream)
        llm.engine.runner.native_decode = checked
        for B in (1, 3):
            decode(llm, B, seed=B)
        assert checked.tapped == 2 * 3


def test_native_decode_follows_replaced_weights(tiny_ckpt: Path) -> None:
    """Released and resumed weights come back at new addresses (or the same ones): the plan
    follows them, and greedy outputs are unchanged."""
    llm = LLM(tiny_ckpt)
    want = decode(llm, 3)
    llm.engine.rl.release_memory_occupation(["weights", "kv_cache"])
    llm.engine.rl.resume_memory_occupation(["weights", "kv_cache"])
    checked = Checked(llm)
    llm.engine.runner.native_decode = checked
    assert decode(llm, 3) == want
    assert checked.calls == 3
    # the plan points at the tensors as they are now
    model = llm.model
    native = checked.native
    head = struct.unpack("<5qd3qd", native._current_plan(llm.engine.states, llm.engine.blocks)[0])
    assert head[2:4] == (model.embed_tokens.weight.data_ptr(), model.norm.weight.data_ptr())


def test_native_decode_keeps_to_the_row_caps(tiny_ckpt: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the native GEMM takes at most 4 rows (fp32 on AVX-512 hosts, where oneDNN runs
    more), batches above that run the per-op forward, as its projections would not be the
    native kernel's: simulated here by lowering the cap."""
    from kdaserve.kernels.native import ops

    monkeypatch.setattr(ops, "linear_native_max_rows", lambda weight: 4)
    llm = LLM(tiny_ckpt)
    checked = Checked(llm)
    llm.engine.runner.native_decode = checked
    decode(llm, 4)
    decode(llm, 5)
    assert (checked.calls, checked.skipped) == (3, 3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_decode_runs_experts_as_the_per_op_forward(tiny_ckpt: Path, dtype: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """An expert with enough tokens runs as token blocks, which sum in another order than the
    split weight rows (and bf16 blocks run on AMX tiles where the host has them): the one-call
    forward takes the per-op forward's choice, asked for the experts' dtype (forced here down
    to 2 tokens, so a batch of 16 over 8 experts blocks some and splits others). The row caps
    are raised to 16 for it: where fp32 products of 5+ rows go to oneDNN (AMD's AVX-512) the
    one-call forward would step aside for the whole batch."""
    from kdaserve.kernels.native import ops

    cap = ops.linear_native_max_rows
    monkeypatch.setattr(ops, "linear_native_max_rows", lambda weight: max(16, cap(weight)))
    asked: list[torch.dtype] = []
    monkeypatch.setattr(ops, "moe_blocked_from", lambda dt=torch.float32: asked.append(dt) or 2)
    llm = LLM(tiny_ckpt, dtype=dtype)
    checked = Checked(llm)
    llm.engine.runner.native_decode = checked
    decode(llm, 16, seed=3)
    assert checked.calls == 3
    assert set(asked) == {getattr(torch, dtype)}
