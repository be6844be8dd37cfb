"""Training at tiny scale, end to end: `train-lm` lowers the held-out loss and writes a
checkpoint the engine loads and serves; `train-drafter` distils a DSpark drafter from it whose
held-out acceptance improves, which the engine loads and which keeps greedy outputs
unchanged."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kdaserve import LLM, SamplingParams
from kdaserve.speculative.schedule import StepCost
from kdaserve.training import drafter as train_drafter
from kdaserve.training.lm import TRAINING_LOG, TrainArgs, train_lm

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("lm") / "draft"
    args = TrainArgs(size="draft", steps=12, batch_size=4, seq_len=64, lr=3e-3, warmup=2,
                     eval_windows=4)
    return out, train_lm(out, args)


def test_train_lm_lowers_loss_and_serves(trained: tuple[Path, dict]) -> None:
    out, result = trained
    assert result["held_out_loss"] < result["held_out_loss_start"] - 0.5, result
    assert json.loads((out / TRAINING_LOG).read_text())["steps_run"] == 12
    assert len(result["samples"]) == 3 and all(s["completion"] for s in result["samples"])
    llm = LLM(out)  # the hub format transformers wrote, with the tokenizer beside it
    assert llm.config.num_hidden_layers == 2 and llm.tokenizer is not None
    text = llm.generate(["Question: how many?\nAnswer:"],
                        SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert len(text.token_ids) == 8


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train_drafter.add_parser(parser.add_subparsers())
    return parser.parse_args(["train-drafter", *argv])


def test_train_drafter_learns_and_stays_lossless(trained: tuple[Path, dict],
                                                 tmp_path: Path) -> None:
    target, _ = trained
    out = tmp_path / "dspark"
    result = train_drafter.train_drafter(_args([
        "--target", str(target), "--out", str(out), "--num-prompts", "6",
        "--eval-prompts", "3", "--max-tokens", "24", "--steps", "60", "--batch-size", "32",
        "--block-size", "4", "--hidden-size", "64", "--num-layers", "1",
        "--markov-rank", "16"]))
    assert result["taps"] == [1]  # the last layer of two (the spread collapses)
    assert result["curve"][-1]["loss"] < result["curve"][0]["loss"] - 1.0
    assert result["held_out"]["acceptance_length"] >= result["held_out_start"][
        "acceptance_length"]
    plain = LLM(target, disable_prefix_cache=True)
    spec = LLM(target, disable_prefix_cache=True, speculative_algorithm="dspark",
               speculative_draft_model=str(out), speculative_num_draft_tokens=4)
    prompts = ["Question: Tom has 3 apples and buys 5 more. How many?\nAnswer:",
               "Question: A train goes 60 miles in 2 hours. How fast?\nAnswer:"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    assert spec.get_metrics()["spec_num_verifies"] > 0
    spec.check_integrity()


@pytest.fixture(scope="module")
def trained_k3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("k3lm") / "draft"
    args = TrainArgs(arch="k3", size="draft", steps=12, batch_size=4, seq_len=64, lr=3e-3,
                     warmup=2, eval_windows=4)
    return out, train_lm(out, args)


def test_train_lm_k3_writes_what_it_trained(trained_k3: tuple[Path, dict]) -> None:
    """`--arch k3`: the loss falls; the saved checkpoint is K3's released layout with the
    trained values (the engine's held-out loss on it is the trainer's), the router biases
    balanced away from their start, and mlx-lm's kimi_k3 reads it to the same logits."""
    import torch

    from kdaserve.models.loader import random_tensor
    from kdaserve.training.data import gsm8k_rows, tiled, token_stream
    from kdaserve.training.k3 import BALANCE_RATE, K3Trainee

    out, result = trained_k3
    assert result["held_out_loss"] < result["held_out_loss_start"] - 0.5, result
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        "KimiK3ForConditionalGeneration"]
    llm = LLM(out, disable_prefix_cache=True)
    test = tiled(token_stream(gsm8k_rows("test"), llm.tokenizer.encode), 64)[:4]
    total = 0.0
    for x in test:
        logits = llm.prefill_logits(x.tolist())[:-1]
        total += torch.nn.functional.cross_entropy(logits, x[1:], reduction="sum").item()
    assert abs(total / (4 * 63) - result["held_out_loss"]) < 1e-3
    name = "language_model.model.layers.1.block_sparse_moe.gate.e_score_correction_bias"
    bias = llm.engine.model.checkpoint_tensors()[name]
    assert isinstance(bias, torch.Tensor)
    moved = (bias.float() - random_tensor(name, tuple(bias.shape), 0)).abs()
    assert moved.max() > 5e-3  # 12 steps of 1e-3, each expert pushed one way or the other
    trainee = K3Trainee(out)  # one balancing step by hand: the busy experts' biases go down
    start = [b.clone() for b in trainee.biases]
    busy = torch.tensor([[0, 1]] * 8)  # 16 picks, all of experts 0 and 1
    trainee.routing = [busy for _ in trainee.biases]
    trainee.balance()
    step = trainee.biases[0] - start[0]
    assert torch.allclose(step[:2], torch.tensor(-BALANCE_RATE))
    assert torch.allclose(step[2:], torch.tensor(BALANCE_RATE))
    pytest.importorskip("mlx_lm.models.kimi_k3")
    from . import mlx_k3

    ids = test[0].tolist()
    ref = mlx_k3.logits(mlx_k3.load(out), ids)
    ours = llm.prefill_logits(ids)
    assert (ours - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("fmt", ["k3-dspark-mla", "k3-dspark-gqa", "dflash"])
def test_train_drafter_format_learns_and_stays_lossless(trained_k3: tuple[Path, dict],
                                                        tmp_path: Path, fmt: str) -> None:
    """`--format`: a K3 published-format drafter distilled from the K3 target; the engine
    loads what it wrote by path and decodes the target's greedy tokens with it."""
    from kdaserve.training.context_drafter import train_context_drafter

    target, _ = trained_k3
    out = tmp_path / fmt
    result = train_context_drafter(_args([
        "--target", str(target), "--out", str(out), "--format", fmt, "--num-prompts", "6",
        "--eval-prompts", "3", "--max-tokens", "24", "--steps", "60", "--batch-size", "32",
        "--sequences-per-step", "4", "--num-layers", "1", "--markov-rank", "16"]))
    assert result["drafts"] == 7 and result["taps"] == [1]
    assert result["curve"][-1]["loss"] < result["curve"][0]["loss"] - 1.0
    assert result["held_out"]["acceptance_length"] >= result["held_out_start"][
        "acceptance_length"]
    assert json.loads((out / "config.json").read_text())["architectures"][0] == {
        "k3-dspark-mla": "K3DSparkModel", "k3-dspark-gqa": "DSparkDraftModel",
        "dflash": "DFlashDraftModel"}[fmt]
    plain = LLM(target, disable_prefix_cache=True)
    spec = LLM(target, disable_prefix_cache=True, speculative_draft_model=str(out),
               speculative_algorithm="dflash" if fmt == "dflash" else "dspark")
    spec.engine.spec.cost = StepCost(fitted=False, prior_tokens=float("inf"))  # draft always
    prompts = ["Question: Tom has 3 apples and buys 5 more. How many?\nAnswer:",
               "Question: A train goes 60 miles in 2 hours. How fast?\nAnswer:"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    m = spec.get_metrics()
    assert m["spec_num_verifies"] > 0 and m["spec_num_accepted"] > 0
    spec.check_integrity()
