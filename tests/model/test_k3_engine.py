"""Kimi K3 on the engine's other paths: speculative decoding with rollback, preemption,
hidden states and routing replay, deterministic inference and RL weight updates by the
released names. Each gives the plain engine's greedy tokens (test_k3.py ties those to
mlx-lm's `kimi_k3`), and hidden states and routing are checked against mlx-lm directly."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kdaserve import LLM, RequestOptions, SamplingParams
from kdaserve.checkpoint import make_checkpoint, preset_config
from kdaserve.speculative.block import make_block_drafter
from kdaserve.speculative.dspark import make_dspark_drafter
from kdaserve.speculative.schedule import StepCost
from kdaserve.speculative.scripted import ScriptedDrafter

from .conftest import MIN_MARGIN, clear_prompt, routing_margin, serialize

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm.models.kimi_k3")
from . import mlx_k3  # noqa: E402 - after the skip

NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(k3_ckpt: Path) -> LLM:
    return LLM(k3_ckpt, disable_prefix_cache=True)


@pytest.fixture(scope="module")
def prompts(plain: LLM) -> list[list[int]]:
    return [clear_prompt(plain, n, seed=300 + n, continuation=NEW) for n in (3, 17, 40, 66)]


@pytest.fixture(scope="module")
def want(plain: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]


@pytest.fixture(scope="module")
def mlx_model(k3_ckpt: Path):  # noqa: ANN201 - an mlx_lm model
    return mlx_k3.load(k3_ckpt)


@pytest.mark.parametrize("corrupt", [set(), {0}, {2}], ids=["all", "none", "some"])
def test_speculation_with_rollback_keeps_plain_tokens(k3_ckpt: Path, prompts: list[list[int]],
                                                      want: list[list[int]],
                                                      corrupt: set[int]) -> None:
    """Drafts of the target's own tokens, corrupted at a known position, so verifies accept
    all, none or some of them: the rejected tail's KDA states and AttnRes-fed layers are
    rolled back, and the tokens stay plain decoding's."""
    k = 4
    llm = LLM(k3_ckpt, speculative_algorithm="ngram", speculative_num_draft_tokens=k)
    futures = {tuple(p): w for p, w in zip(prompts, want, strict=True)}
    llm.engine.spec.drafter = ScriptedDrafter(  # type: ignore[union-attr]
        None, k, llm.config.vocab_size, futures, corrupt)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == want
    m = llm.get_metrics()
    assert m["spec_num_verifies"] > 0
    rate = m["spec_num_accepted"] / m["spec_num_drafted"]
    assert rate == 1.0 if not corrupt else (rate == 0 if 0 in corrupt else 0 < rate < 1)
    llm.check_integrity()


def test_preemption_and_chunks_keep_plain_tokens(k3_ckpt: Path, prompts: list[list[int]],
                                                 want: list[list[int]]) -> None:
    llm = LLM(k3_ckpt, max_num_batched_tokens=16, block_size=4, snapshot_interval=8,
              max_total_tokens=96)  # room for about one long request: the rest wait or recompute
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == want
    assert llm.get_metrics()["num_preemptions"] > 0
    llm.check_integrity()


def test_hidden_states_and_routing_match_mlx(k3_ckpt: Path, prompts: list[list[int]],
                                            mlx_model) -> None:  # noqa: ANN001
    """return_hidden_states and return_routed_experts through chunked, batched decoding,
    against mlx-lm's final-normed hidden states and its router's choices on the whole
    sequence."""
    llm = LLM(k3_ckpt, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, options=RequestOptions(
        return_hidden_states=True, return_routed_experts=True))
    compared = 0
    for p, out in zip(prompts, outs, strict=True):
        seq = p + out.token_ids[:-1]  # the last token was never forwarded
        h, r = out.outputs[0].hidden_states, out.outputs[0].routed_experts
        assert h is not None and r is not None and h.shape[0] == r.shape[0] == len(seq)
        ref = mlx_k3.hidden(mlx_model, seq)
        torch.testing.assert_close(h, ref, atol=1e-4 * max(1.0, ref.abs().max().item()),
                                   rtol=1e-4)
        if routing_margin(llm, seq) > MIN_MARGIN:  # no near-tie for float noise to flip
            theirs = mlx_k3.routing(mlx_model, seq)
            assert r.shape == theirs.shape
            assert torch.equal(r.sort(-1).values, theirs.sort(-1).values)
            compared += 1
    assert compared > 0
    llm.check_integrity()


def test_deterministic_inference_same_bits_in_any_batch(k3_ckpt: Path,
                                                        prompts: list[list[int]]) -> None:
    """The batch-invariant kernels on K3 (its gate, SiTU, the AttnRes mix): one request's
    tokens and logprobs are bit-identical alone, among others and chunked."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)

    def run(llm: LLM, batch: list[list[int]]) -> tuple:
        out = llm.generate(prompt_token_ids=batch, sampling_params=params)[-1].outputs[0]
        return out.token_ids, out.logprobs, out.cumulative_logprob

    det = LLM(k3_ckpt, enable_deterministic_inference=True)
    alone = run(det, prompts[2:3])
    assert run(det, [*prompts[:2], prompts[3], prompts[2]]) == alone
    chunked = LLM(k3_ckpt, enable_deterministic_inference=True, max_num_batched_tokens=7)
    assert run(chunked, [prompts[0], prompts[2]]) == alone
    det.check_integrity()


def test_weight_updates_by_released_names(k3_ckpt: Path, tmp_path: Path,
                                          prompts: list[list[int]],
                                          want: list[list[int]]) -> None:
    """An RL refit from disk and from tensors named as the release names them
    (`language_model.` prefix, per-expert w1/w2/w3, A_log longer than the heads): the engine
    then decodes as a fresh engine on the new weights, and back."""
    other = make_checkpoint(tmp_path / "k3-other", "k3-tiny", seed=8, dtype="float32")
    new = [o.token_ids for o in LLM(other).generate(prompt_token_ids=prompts,
                                                     sampling_params=GREEDY)]
    assert new != want
    llm = LLM(k3_ckpt)
    llm.engine.rl.update_weights_from_disk(str(other), weight_version="v1")
    assert [o.token_ids for o in llm.generate(prompt_token_ids=prompts,
                                              sampling_params=GREEDY)] == new
    named = {}
    for f in sorted(k3_ckpt.glob("*.safetensors")):
        named.update(load_file(str(f)))
    assert any(n.startswith("language_model.") for n in named)
    a_log = next(n for n in named if n.endswith("A_log"))
    with pytest.raises(ValueError, match="shape"):  # shorter than the heads: refused whole
        llm.engine.rl.update_weights_from_tensor([serialize([(a_log, named[a_log][:1])])])
    llm.engine.rl.update_weights_from_tensor([serialize(list(named.items()))], "v2")
    assert [o.token_ids for o in llm.generate(prompt_token_ids=prompts,
                                              sampling_params=GREEDY)] == want
    llm.check_integrity()


@pytest.mark.parametrize("drafter", ["self", "block", "dspark"])
def test_drafters_on_a_k3_target_keep_plain_tokens(k3_ckpt: Path, tmp_path: Path,
                                                   prompts: list[list[int]],
                                                   want: list[list[int]], drafter: str) -> None:
    """The draft-model, block and DSpark drafters (DSpark tapping a KDA and an MLA layer's
    AttnRes-era outputs) on a K3 target, with prefill chunks: tokens stay plain decoding's,
    drafts are verified, and the target's own function as drafter is always accepted."""
    config = preset_config("k3-tiny")
    path = {"self": lambda: k3_ckpt,
            "block": lambda: make_block_drafter(tmp_path / "block", config, seed=3),
            "dspark": lambda: make_dspark_drafter(tmp_path / "dspark", config, taps=[1, 3],
                                                  seed=4)}[drafter]()
    llm = LLM(k3_ckpt, speculative_algorithm="draft" if drafter == "self" else drafter,
              speculative_draft_model=str(path), max_num_batched_tokens=24)
    # every draft verified whatever the timings (random drafts would rightly be stopped)
    llm.engine.spec.cost = StepCost(fitted=False, prior_tokens=math.inf)  # type: ignore
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == want
    m = llm.get_metrics()
    assert m["spec_num_verifies"] > 0 and m["spec_num_drafted"] > 0
    if drafter == "self":
        assert m["spec_num_accepted"] == m["spec_num_drafted"]
    llm.check_integrity()


def _broadcast_trainer(port: int, path: str, names: list[str]) -> None:
    """Rank 0 of a weight-update group: broadcasts `path`'s tensors in `names`' order."""
    import torch.distributed as dist

    named: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        named.update(load_file(str(f)))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0)
    try:
        for name in names:
            dist.broadcast(named[name], src=0)
    finally:
        dist.destroy_process_group()


def test_distributed_weight_update_by_released_names(k3_ckpt: Path, tmp_path: Path,
                                                     prompts: list[list[int]]) -> None:
    """A trainer process broadcasts another K3 checkpoint's tensors by their released names
    (torch.distributed, gloo): the engine then decodes as a fresh engine on them."""
    import multiprocessing as mp

    from tests.ports import free_port

    other = make_checkpoint(tmp_path / "k3-other", "k3-tiny", seed=9, dtype="float32")
    new = [o.token_ids for o in LLM(other).generate(prompt_token_ids=prompts,
                                                     sampling_params=GREEDY)]
    meta = {}
    for f in sorted(other.glob("*.safetensors")):
        meta.update({k: (str(v.dtype), list(v.shape)) for k, v in load_file(str(f)).items()})
    names = sorted(meta)
    llm = LLM(k3_ckpt)
    port = free_port()
    trainer = mp.get_context("spawn").Process(target=_broadcast_trainer,
                                              args=(port, str(other), names))
    trainer.start()
    try:
        llm.engine.rl.init_weights_update_group("127.0.0.1", port, 1, 2).result(timeout=120)
        llm.engine.rl.update_weights_from_distributed(names, [meta[n][0] for n in names],
                                           [meta[n][1] for n in names], weight_version="d1")
        llm.engine.rl.destroy_weights_update_group()
    finally:
        trainer.join(timeout=60)
    assert [o.token_ids for o in llm.generate(prompt_token_ids=prompts,
                                              sampling_params=GREEDY)] == new
    llm.check_integrity()
