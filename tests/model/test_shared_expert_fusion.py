"""The shared expert inside the experts kernel (`Kernels.fuse_shared_expert`: the triton
backend's layout, expert E taken by every token with weight 1) on the CPU: the engine gives
the separate dense MLP's greedy tokens and logprobs, the checkpoint's and transformers' names
land in the fused slot (loading, weight-only int8, RL updates), and routing replay still
records the routed experts only. The triton kernel itself runs it in
tests/kernels/interpreted/check_graph_step.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kdaserve import LLM, RequestOptions, SamplingParams
from kdaserve.engine import llm_engine
from kdaserve.engine.native_decode import Unsupported
from kdaserve.kernels import resolve_kernels
from kdaserve.layers.moe import MoE

from .conftest import serialize

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
PROMPTS = [[5, 9, 17, 33], list(range(40, 110)), [7] * 19]


def fused_llm(monkeypatch: pytest.MonkeyPatch, path: Path, **kw: object) -> LLM:
    with monkeypatch.context() as m:
        m.setattr(llm_engine, "resolve_kernels", lambda *a, **k: resolve_kernels(
            *a, **k)._replace(fuse_shared_expert=True))
        llm = LLM(path, **kw)
    moes = [m for m in llm.model.modules() if isinstance(m, MoE)]
    assert moes and all(m.shared_experts is None and m.shared_slot == m.config.num_experts
                        and m.w13.shape[0] == m.w2.shape[0] == m.config.num_experts + 1
                        for m in moes)
    return llm


def run(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    return [(o.token_ids, o.outputs[0].logprobs or [])
            for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]


def same(a, b, tol: float = 1e-4) -> None:  # noqa: ANN001
    for (ta, la), (tb, lb) in zip(a, b, strict=True):
        assert ta == tb
        for x, y in zip(la, lb, strict=True):
            assert x.keys() == y.keys()
            assert all(abs(x[k] - y[k]) <= tol for k in x)


@pytest.mark.parametrize("backend", ["ref", None])
def test_fused_shared_expert_equals_the_dense_mlp(tiny_ckpt: Path, backend: str | None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference experts and the native ones (the one-call native decode refuses the
    layout, so the per-op forward runs), against the plain engine with a dense shared MLP."""
    fused = fused_llm(monkeypatch, tiny_ckpt, kernel_backend=backend)
    plain = LLM(tiny_ckpt, kernel_backend=backend)
    same(run(fused), run(plain))
    if backend is None:  # the native one-call decode exists and refuses the fused layout
        e = fused.engine
        with pytest.raises(Unsupported):
            fused.engine.runner.native_decode._current_plan(e.states, e.blocks)
    ids = list(range(3, 200))
    torch.testing.assert_close(fused.prefill_logits(ids), plain.prefill_logits(ids),
                               atol=1e-4, rtol=1e-4)
    fused.check_integrity()


def test_fused_slot_holds_the_checkpoints_shared_expert(tiny_ckpt: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    fused = fused_llm(monkeypatch, tiny_ckpt, kernel_backend="ref")
    plain = LLM(tiny_ckpt, kernel_backend="ref")
    views = fused.model.checkpoint_tensors()
    for i, layer in enumerate(fused.model.layers):
        m = layer.mlp
        if not isinstance(m, MoE):
            continue
        dense = plain.model.layers[i].mlp.shared_experts
        inter = m.w2.shape[-1]
        E = m.shared_slot
        torch.testing.assert_close(m.w13[E], dense.gate_up_proj.weight, atol=0, rtol=0)
        torch.testing.assert_close(m.w2[E], dense.down_proj.weight, atol=0, rtol=0)
        gate = views[f"model.layers.{i}.block_sparse_moe.shared_experts.gate_proj.weight"]
        assert gate.data_ptr() == m.w13[E, :inter].data_ptr()  # a view, not a copy
    hf_names = fused.model.transformers_tensors()
    gate_up = [v for k, v in hf_names.items() if k.endswith("mlp.experts.gate_up_proj")]
    assert gate_up and all(v.shape[0] == fused.model.config.num_experts for v in gate_up)


def test_int8_and_routing_replay_with_the_fused_slot(tiny_ckpt: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Weight-only int8 quantizes the fused slot per row as it did the dense MLP's rows; the
    routing record holds the routed experts' ids only."""
    fused = fused_llm(monkeypatch, tiny_ckpt, kernel_backend="ref", quantization="int8")
    plain = LLM(tiny_ckpt, kernel_backend="ref", quantization="int8")
    same(run(fused), run(plain))
    replay = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    a, b = (llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=replay,
                         options=RequestOptions(return_routed_experts=True))[0]
            for llm in (fused, plain))
    assert a.token_ids == b.token_ids
    ra, rb = (torch.as_tensor(o.outputs[0].routed_experts) for o in (a, b))
    assert torch.equal(ra, rb)
    assert int(ra.max()) < fused.model.config.num_experts


def test_rl_updates_land_in_the_fused_slot(tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch,
                                           tmp_path_factory: pytest.TempPathFactory) -> None:
    """From disk by the checkpoint's names, then from transformers' module by its names: the
    fused engine then generates what the plain engine updated alike generates."""
    from kdaserve.checkpoint import make_checkpoint

    from .conftest import load_hf

    other = make_checkpoint(tmp_path_factory.mktemp("tiny-fused-other"), "tiny", seed=7)
    fused = fused_llm(monkeypatch, tiny_ckpt, kernel_backend="ref")
    plain = LLM(tiny_ckpt, kernel_backend="ref")
    for llm in (fused, plain):
        llm.engine.rl.update_weights_from_disk(str(other), weight_version="v1")
    same(run(fused), run(plain))
    hf = load_hf(tiny_ckpt)
    named = [(k, v.detach().clone()) for k, v in hf.named_parameters()] + [
        (k, v.clone()) for k, v in hf.named_buffers() if "e_score_correction_bias" in k]
    for llm in (fused, plain):
        llm.engine.rl.update_weights_from_tensor([serialize(named)], "hf")
    same(run(fused), run(plain))
    fused.check_integrity()
