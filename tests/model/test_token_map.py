"""Hot-token maps: a block or DSpark drafter cut to a token map drafts exactly the full
head's choice among the map's tokens (the reference: the uncut network's logits with every
other token masked), verification stays lossless, and a bad map or a map for a drafter
without a head is refused."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kdaserve import LLM, SamplingParams
from kdaserve.checkpoint import preset_config
from kdaserve.speculative.block import BlockDrafter, BlockDraftNet, make_block_drafter
from kdaserve.speculative.dspark import DSparkNet, make_dspark_drafter
from kdaserve.speculative.schedule import StepCost
from kdaserve.speculative.token_map import hot_tokens, load_token_map, save_token_map
from kdaserve.training import token_map as token_map_cli

from .conftest import SPEC_NEW, greedy_outputs

VOCAB = preset_config("tiny").vocab_size


@pytest.fixture(scope="module")
def dspark_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dspark_drafter(tmp_path_factory.mktemp("dspark"), preset_config("tiny"),
                               taps=[0, 2], seed=6)


@pytest.fixture(scope="module")
def block_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_block_drafter(tmp_path_factory.mktemp("block"), preset_config("tiny"), seed=7)


@pytest.fixture(scope="module")
def hot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A third of the vocabulary, in a shuffled order (a map's order is its own)."""
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))[:VOCAB // 3]
    return save_token_map(ids.tolist(), tmp_path_factory.mktemp("map") / "hot.pt")


def _masked_argmax(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    masked = torch.full_like(logits, -math.inf)
    masked[..., ids] = logits[..., ids]
    return masked.argmax(-1)


def test_cut_dspark_drafts_the_full_heads_choice_among_the_map(dspark_path: Path,
                                                                hot: Path) -> None:
    cfg = json.loads((dspark_path / "config.json").read_text())
    full, cut = DSparkNet(cfg), DSparkNet(cfg)
    full.load_state_dict(load_file(dspark_path / "model.safetensors"))
    cut.load_state_dict(load_file(dspark_path / "model.safetensors"))
    ids = load_token_map(hot, VOCAB)
    cut.restrict_vocab(ids)
    assert cut.lm_head.weight.shape[0] == cut.markov_out.weight.shape[0] == ids.numel()
    g = torch.Generator().manual_seed(3)
    taps = torch.randn(6, 2 * cfg["target_hidden_size"], generator=g)
    tokens = torch.randint(0, VOCAB, (6,), generator=g)
    drafts, conf = cut.draft(taps, tokens, cfg["block_size"])
    assert set(drafts.flatten().tolist()) <= set(ids.tolist())
    # the uncut network teacher-forced on the cut drafts, then masked to the map
    prev = torch.cat([tokens[:, None], drafts[:, :-1]], 1)
    logits, conf_logits = full(taps, tokens, prev)
    assert torch.equal(_masked_argmax(logits, ids), drafts)
    torch.testing.assert_close(torch.sigmoid(conf_logits), conf)  # the head is not cut
    # and the map matters: the uncut drafts leave it somewhere
    assert not set(full.draft(taps, tokens, cfg["block_size"])[0].flatten().tolist()) \
        <= set(ids.tolist())


def test_cut_block_drafter_drafts_the_full_heads_choice(block_path: Path, hot: Path) -> None:
    cfg = json.loads((block_path / "config.json").read_text())
    net = BlockDraftNet(cfg)
    net.load_state_dict(load_file(block_path / "model.safetensors"))
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(5, cfg["target_hidden_size"], generator=g)
    tokens = torch.randint(0, VOCAB, (5,), generator=g)
    ids = load_token_map(hot, VOCAB)
    want = _masked_argmax(net(hidden, tokens), ids)
    d = BlockDrafter.load(block_path, preset_config("tiny"), cfg["block_size"], torch.float32,
                          torch.device("cpu"))
    d.restrict_vocab(ids)
    drafts, conf = d.draft(hidden, tokens, cfg["block_size"])
    assert torch.equal(drafts, want)
    assert bool((conf > 0).all() and (conf <= 1).all())


@pytest.mark.parametrize("algorithm", ["dspark", "block"])
def test_cut_drafters_keep_greedy_outputs(tiny_ckpt: Path, spec_plain: LLM,
                                          spec_prompts: list[list[int]], dspark_path: Path,
                                          block_path: Path, hot: Path, algorithm: str) -> None:
    path = dspark_path if algorithm == "dspark" else block_path
    llm = LLM(tiny_ckpt, speculative_algorithm=algorithm, speculative_draft_model=str(path),
              speculative_token_map=str(hot))
    spec = llm.engine.spec
    assert spec is not None
    spec.cost = StepCost(fitted=False, prior_tokens=math.inf)  # verify every draft
    proposed: list[int] = []
    propose = spec.drafter.propose

    def recording(reqs):  # noqa: ANN001, ANN202
        propose(reqs)
        proposed.extend(t for r in reqs for t in r.draft_ids)
    spec.drafter.propose = recording  # type: ignore[method-assign]
    assert greedy_outputs(llm, spec_prompts) == greedy_outputs(spec_plain, spec_prompts)
    assert llm.get_metrics()["spec_num_verifies"] > 0
    assert proposed and set(proposed) <= set(load_token_map(hot, VOCAB).tolist())
    llm.check_integrity()


def test_token_map_files(tmp_path: Path) -> None:
    ids = [5, 0, 17]
    for name in ("m.pt", "m.json"):
        assert load_token_map(save_token_map(ids, tmp_path / name), VOCAB).tolist() == ids
    bad = {"empty.json": "[]", "dup.json": "[1, 2, 1]", "range.json": f"[0, {VOCAB}]",
           "neg.json": "[-1]", "float.json": "[1.5]", "dict.json": '{"ids": [1]}',
           "text.json": "not json", "m.txt": "[1]"}
    for name, text in bad.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match="speculative_token_map"):
            load_token_map(tmp_path / name, VOCAB)
    torch.save(torch.tensor([[1, 2]]), tmp_path / "2d.pt")
    torch.save(torch.tensor([1.0]), tmp_path / "float.pt")
    (tmp_path / "junk.pt").write_bytes(b"junk")
    for name in ("2d.pt", "float.pt", "junk.pt", "missing.pt"):
        with pytest.raises(ValueError, match="speculative_token_map"):
            load_token_map(tmp_path / name, VOCAB)


def test_hot_tokens_rank_by_frequency() -> None:
    ids, covered = hot_tokens([[3, 3, 9, 1], [9, 3, 7], [1]], 3)
    assert ids == [3, 1, 9]  # 3 thrice; 1 and 9 twice each: the lower id first
    assert covered == pytest.approx(7 / 8)


def test_token_map_is_refused_where_it_has_no_effect(tiny_ckpt: Path, dspark_path: Path,
                                                     hot: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="speculative_token_map applies"):
        LLM(tiny_ckpt, speculative_algorithm="ngram", speculative_token_map=str(hot))
    with pytest.raises(ValueError, match="speculative_token_map applies"):
        LLM(tiny_ckpt, speculative_token_map=str(hot))
    far = save_token_map([0, VOCAB + 5], tmp_path / "far.json")
    with pytest.raises(ValueError, match="token ids must be in"):
        LLM(tiny_ckpt, speculative_algorithm="dspark", speculative_draft_model=str(dspark_path),
            speculative_token_map=str(far))


def test_token_map_command(tiny_ckpt: Path, gsm8k_file: Path, tmp_path: Path) -> None:
    """`kdaserve token-map` over GSM8K train text: the most frequent tokens, most first."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text(gsm8k_file.read_text())
    out = tmp_path / "map.json"
    token_map_cli.main(argparse.Namespace(model=str(tiny_ckpt), size=20, data_dir=str(data),
                                          out=str(out)))
    ids = json.loads(out.read_text())
    llm = LLM(tiny_ckpt, disable_prefix_cache=True)
    from kdaserve.training.data import gsm8k_rows, record

    want, _ = hot_tokens((llm.tokenizer.encode(record(r)) for r in gsm8k_rows("train", data)),
                         20)
    assert ids == want and len(ids) == 20
    params = SamplingParams(temperature=0.0, max_tokens=SPEC_NEW, ignore_eos=True)
    served = LLM(tiny_ckpt, speculative_algorithm="block", speculative_draft_model=str(
        make_block_drafter(tmp_path / "b", preset_config("tiny"))),
        speculative_token_map=str(out)).generate(prompt_token_ids=[ids[:5]],
                                                 sampling_params=params)
    assert served[0].token_ids == llm.generate(prompt_token_ids=[ids[:5]],
                                               sampling_params=params)[0].token_ids
