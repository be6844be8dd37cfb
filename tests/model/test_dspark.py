"""DSpark: the engine hands the drafter the target's tapped rows a plain forward computes, the
sequential Markov drafting is the function training teacher-forces, and a broken drafter
checkpoint is refused with its fault named."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kdaserve import LLM, SamplingParams
from kdaserve.checkpoint import preset_config
from kdaserve.request import Request
from kdaserve.speculative.dspark import DSparkDrafter, DSparkNet, make_dspark_drafter
from kdaserve.speculative.schedule import StepCost

from .conftest import SPEC_NEW

TAPS = [0, 2]


@pytest.fixture(scope="module")
def drafter_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dspark_drafter(tmp_path_factory.mktemp("dspark"), preset_config("tiny"),
                               taps=TAPS, seed=5)


class Recording(DSparkDrafter):
    """Keeps every tapped row the engine passes, with the ids it belongs after."""

    def __init__(self, inner: DSparkDrafter) -> None:
        super().__init__(inner.net, inner.k, inner.device)  # type: ignore[arg-type]
        self.seen: list[tuple[list[int], torch.Tensor]] = []

    def on_accept(self, req: Request, num_accepted: int,
                  hidden: torch.Tensor | None = None) -> None:
        assert hidden is not None
        self.seen.append((list(req.all_ids), hidden.clone()))
        super().on_accept(req, num_accepted, hidden)


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 16}], ids=["plain", "chunked"])
def test_engine_taps_equal_a_plain_forward(tiny_ckpt: Path, drafter_path: Path,
                                           spec_plain: LLM, spec_prompts: list[list[int]],
                                           kw: dict) -> None:
    """In a batch, chunked or not, after verifies that kept some drafts or none: the row
    given with each new token is the tapped residual stream at the position whose logits
    chose that token, as one forward over the sequence computes it."""
    llm = LLM(tiny_ckpt, speculative_algorithm="dspark",
              speculative_draft_model=str(drafter_path), **kw)
    spec = llm.engine.spec
    assert spec is not None and isinstance(spec.drafter, DSparkDrafter)
    rec = Recording(spec.drafter)
    # verify every draft: rows after rollbacks get checked too
    spec.cost = StepCost(fitted=False, prior_tokens=math.inf)
    spec.drafter = rec
    params = SamplingParams(temperature=0.0, max_tokens=SPEC_NEW, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=spec_prompts[:4], sampling_params=params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in spec_plain.generate(
        prompt_token_ids=spec_prompts[:4], sampling_params=params)]
    assert llm.get_metrics()["spec_num_verifies"] > 0
    assert len(rec.seen) > 20
    for ids, row in rec.seen[::3]:
        _, taps = spec_plain.prefill_taps(ids[:-1], tuple(TAPS))
        assert taps is not None and row.shape == taps[-1].shape
        torch.testing.assert_close(row, taps[-1], atol=2e-4, rtol=1e-4)
    llm.check_integrity()


def test_draft_is_the_teacher_forced_function(drafter_path: Path) -> None:
    """Drafting feeds the Markov head its own previous draft; training feeds it the true
    previous token. With the drafts as the true tokens the two must choose alike."""
    cfg = json.loads((drafter_path / "config.json").read_text())
    net = DSparkNet(cfg)
    net.load_state_dict(load_file(drafter_path / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    taps = torch.randn(5, len(TAPS) * cfg["target_hidden_size"], generator=g)
    tokens = torch.randint(0, cfg["vocab_size"], (5,), generator=g)
    drafts, conf = net.draft(taps, tokens, cfg["block_size"])
    prev = torch.cat([tokens[:, None], drafts[:, :-1]], 1)
    logits, conf_logits = net(taps, tokens, prev)
    assert torch.equal(logits.argmax(-1), drafts)
    torch.testing.assert_close(torch.sigmoid(conf_logits), conf)
    assert conf.std() > 0.01  # the confidences differ, so verify lengths will
    # the Markov head matters: other previous tokens change some drafts
    other, _ = net(taps, tokens, (prev + 1) % cfg["vocab_size"])
    assert not torch.equal(other.argmax(-1), drafts)


@pytest.mark.parametrize("k", [1, 3])
def test_a_short_draft_runs_a_cut_block(drafter_path: Path, k: int) -> None:
    """Drafting k < block_size positions runs the backbone on the block's first k + 1 rows
    (the drafting pass's cost scales with k), and the drafts are the teacher-forced function
    of that cut block."""
    cfg = json.loads((drafter_path / "config.json").read_text())
    net = DSparkNet(cfg)
    net.load_state_dict(load_file(drafter_path / "model.safetensors"))
    positions: list[int] = []  # of every projection over [B, positions, H] rows
    net.lin = lambda x, mod: (positions.extend(x.shape[1:2] if x.dim() == 3 else []),
                              torch.nn.functional.linear(x, mod.weight))[1]
    g = torch.Generator().manual_seed(1)
    taps = torch.randn(4, len(TAPS) * cfg["target_hidden_size"], generator=g)
    tokens = torch.randint(0, cfg["vocab_size"], (4,), generator=g)
    drafts, conf = net.draft(taps, tokens, k)
    assert drafts.shape == conf.shape == (4, k)
    assert max(positions) == k + 1 < cfg["block_size"] + 1
    z = net.backbone(taps, tokens, k)
    prev = torch.cat([tokens[:, None], drafts[:, :-1]], 1)
    logits = net.lin(z, net.lm_head) + net.lin(net.markov(z, prev), net.markov_out)
    assert torch.equal(logits.argmax(-1), drafts)


def _edit(src: Path, dst: Path, cfg_change: dict | None = None,
          drop: str | None = None) -> Path:
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text()) | (cfg_change or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(src / "model.safetensors")
    if drop:
        del tensors[drop]
    save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("change,match", [
    ({"taps": [0, 9]}, "taps"),  # the tiny target has 4 layers
    ({"taps": [2, 0]}, "increasing"),
    ({"taps": []}, "taps"),
    ({"vocab_size": 100}, "vocab_size"),
    ({"target_hidden_size": 32}, "target_hidden_size"),
    ({"architecture": "kdaserve-block-drafter"}, "not a DSpark drafter"),
    ({"markov_rank": 8}, "do not match"),
    ({"num_heads": 3}, "multiple of num_heads"),
    ({"block_size": 0}, "positive integer"),
], ids=["tap-past-end", "taps-order", "no-taps", "vocab", "hidden", "arch", "shapes",
        "heads", "block"])
def test_broken_drafter_checkpoints_are_refused(tiny_ckpt: Path, drafter_path: Path,
                                                tmp_path: Path, change: dict,
                                                match: str) -> None:
    bad = _edit(drafter_path, tmp_path / "bad", change)
    with pytest.raises(ValueError, match=match):
        LLM(tiny_ckpt, speculative_algorithm="dspark", speculative_draft_model=str(bad))


def test_missing_tensor_is_refused(tiny_ckpt: Path, drafter_path: Path,
                                   tmp_path: Path) -> None:
    bad = _edit(drafter_path, tmp_path / "bad", drop="markov_out.weight")
    with pytest.raises(ValueError, match="markov_out.weight"):
        LLM(tiny_ckpt, speculative_algorithm="dspark", speculative_draft_model=str(bad))
