"""The one-call native decode forward (engine/native_decode.py, csrc/decode_step.cpp) equals
the per-op forward bit for bit (hidden states, KDA states, conv windows, latent cache, a
verify's record), is the path decode and verify steps take where it applies, and steps aside
where it does not."""

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
from kdaserve.speculative.scripted import ScriptedDrafter
from kdaserve.step_record import StepRecord


class Checked:
    """Stands in for the model's NativeDecode: runs the per-op forward on copies of the pools
    (and a record of its own, for a verify) first, then the native one on the real pools, and
    asserts they agree exactly."""

    def __init__(self, llm: LLM) -> None:
        self.model, self.runner = llm.model, llm.engine.runner
        self.native = self.runner.native_decode
        assert self.native is not None
        self.calls = self.skipped = self.verifies = 0

    def takes(self, batch) -> bool:  # noqa: ANN001
        return self.native.takes(batch)

    def __call__(self, batch, states, blocks):  # noqa: ANN001, ANN204
        s2, b2 = copy.copy(states), copy.copy(blocks)
        s2.recurrent, s2.conv, b2.kv = states.recurrent.clone(), states.conv.clone(), \
            blocks.kv.clone()
        record = batch.record
        if record is not None:
            batch.record = copy.copy(record)
            batch.record.layers = []
        want = self.model.forward_hidden(batch, s2, b2)  # the per-op forward
        theirs, batch.record = batch.record, record
        got = self.native(batch, states, blocks)
        if got is None:  # only above the native kernels' row caps
            assert batch.input_ids.shape[0] > self.native.most_rows()
            self.skipped += 1
            states.recurrent.copy_(s2.recurrent)  # the per-op forward's step, kept
            states.conv.copy_(s2.conv)
            blocks.kv.copy_(b2.kv)
            if record is not None:
                record.layers = theirs.layers
            return want
        self.calls += 1
        assert torch.equal(got, want)
        assert torch.equal(states.recurrent, s2.recurrent)
        assert torch.equal(states.conv, s2.conv)
        assert torch.equal(blocks.kv, b2.kv)
        if record is not None:
            self.verifies += 1
            assert len(record.layers) == len(theirs.layers) > 0
            for mine, per_op in zip(record.layers, theirs.layers, strict=True):
                for a, b in zip(mine, per_op, strict=True):
                    assert torch.equal(a, b)
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
    """Other backends get no native forward; prefill chunks, routing capture and snapshots run
    the per-op forward (a drafter's taps and a verify's record do not: the native forward
    takes them, and a verify's few tokens per sequence, all logits rows)."""
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
    assert native.takes(dataclasses.replace(decode_batch, record=StepRecord([0, 1], {}, "cpu")))
    for change in ({"routing": []}, {"snapshots": (torch.zeros(1, dtype=torch.int64),) * 3}):
        assert not native.takes(dataclasses.replace(decode_batch, **change))
    # a verify: 3 and 2 tokens, every row a logits row; a prompt chunk samples its last only
    verify = ForwardBatch.build([[5, 6, 7], [8, 9]], [3, 4], [0, 1], [[0], [1]], 16,
                                all_logits=True)
    assert native.takes(verify)
    assert not native.takes(ForwardBatch.build([[5, 6, 7], [8, 9]], [3, 4], [0, 1], [[0], [1]],
                                               16))
    long = [list(range(17))]
    assert not native.takes(ForwardBatch.build(long, [0], [0], [[0, 1]], 16,
                                               all_logits=True))


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


@pytest.mark.parametrize("tags", [["weights"], ["weights", "kv_cache"]])
def test_native_decode_follows_replaced_weights(tiny_ckpt: Path, tags: list[str]) -> None:
    """Released and resumed weights come back at new addresses (or the same ones), the pools
    too or not (then only RL's word that the weights changed tells the plan): the plan
    follows them, and greedy outputs are unchanged."""
    llm = LLM(tiny_ckpt)
    want = decode(llm, 3)
    llm.engine.rl.release_memory_occupation(tags)
    llm.engine.rl.resume_memory_occupation(tags)
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
    """Where the native GEMM takes fewer rows than a batch has (fp32 above 16 rows on Intel's
    AVX-512, where oneDNN runs more), the batch runs the per-op forward, as its projections
    would not be the native kernel's: simulated here by lowering the cap to 4."""
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
    are raised to 16 for it: where a host's fp32 products of fewer rows go to oneDNN the
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


@pytest.mark.parametrize("corrupt", [set(), {2}, {0}], ids=["all", "some", "none"])
def test_native_verify_equals_per_op_forward(tiny_ckpt: Path, k3_ckpt: Path,
                                             corrupt: set[int]) -> None:
    """A speculative verify (4 drafts per request, all, some or none accepted; batch 1 and a
    batch of 3) runs in the one call: hidden states, pools and each KDA layer's recorded step
    inputs equal the per-op forward's bit for bit, and the greedy outputs (after the rollback
    replays the record) are plain decoding's."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for ckpt in (tiny_ckpt, k3_ckpt):
        plain = LLM(ckpt)
        g = torch.Generator().manual_seed(7)
        prompts = [torch.randint(0, 3800, (int(n),), generator=g).tolist()
                   for n in torch.randint(3, 30, (3,), generator=g)]
        refs = [o.token_ids for o in plain.generate(prompt_token_ids=prompts,
                                                    sampling_params=params)]
        llm = LLM(ckpt, speculative_algorithm="ngram", speculative_num_draft_tokens=4)
        futures = {tuple(p): r for p, r in zip(prompts, refs, strict=True)}
        llm.engine.spec.drafter = ScriptedDrafter(None, 4, llm.config.vocab_size, futures,
                                                  corrupt)
        checked = Checked(llm)
        llm.engine.runner.native_decode = checked
        for batch in ([prompts[0]], prompts):
            outs = llm.generate(prompt_token_ids=batch, sampling_params=params)
            assert [o.token_ids for o in outs] == refs[:len(batch)]
        assert checked.verifies >= 4
        llm.check_integrity()
