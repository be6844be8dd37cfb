"""The draft-model and block drafters: greedy outputs identical to plain decoding in mixed
batches, with chunked prefill, prefix-cache hits and preemption, and when 0, some or all drafts
are accepted; the draft model's own KDA state rolled back exactly (a self-draft then keeps
proposing the target's tokens); target and draft pools consistent after every test."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kdaserve import LLM, SamplingParams
from kdaserve.checkpoint import make_checkpoint, preset_config
from kdaserve.config import DENSE, KDA, MLA, MOE
from kdaserve.engine_config import DEFAULT_DRAFTS, EngineConfig
from kdaserve.speculative.block import BlockDrafter, make_block_drafter
from kdaserve.speculative.draft_model import memory_plan as draft_memory_plan
from kdaserve.speculative.dspark import make_dspark_drafter
from kdaserve.speculative.schedule import StepCost
from kdaserve.speculative.scripted import ScriptedDrafter

from .conftest import SPEC_NEW as NEW
from .conftest import greedy_outputs as reference

GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A different, smaller random checkpoint with the tiny target's vocabulary."""
    config = preset_config("tiny", num_hidden_layers=2, layer_types=(KDA, MLA),
                           mlp_types=(DENSE, MOE))
    return make_checkpoint(tmp_path_factory.mktemp("draft"), config, seed=7)


@pytest.fixture(scope="module")
def block_drafter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_block_drafter(tmp_path_factory.mktemp("block"), preset_config("tiny"), seed=3)


@pytest.fixture(scope="module")
def dspark_drafter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Taps the tiny target's layers 0 and 2 (a KDA layer's and an MLA layer's output)."""
    return make_dspark_drafter(tmp_path_factory.mktemp("dspark"), preset_config("tiny"),
                               taps=[0, 2], seed=4)


@pytest.fixture(scope="module")
def drafters(tiny_ckpt: Path, small_draft: Path, block_drafter: Path,
             dspark_drafter: Path) -> dict[str, dict]:
    return {
        "dspark": {"speculative_algorithm": "dspark",
                   "speculative_draft_model": str(dspark_drafter)},
        "self": {"speculative_algorithm": "draft", "speculative_draft_model": str(tiny_ckpt)},
        "small": {"speculative_algorithm": "draft", "speculative_draft_model": str(small_draft)},
        "block": {"speculative_algorithm": "block",
                  "speculative_draft_model": str(block_drafter)},
    }


@pytest.mark.parametrize("drafter", ["self", "small", "block", "dspark"])
@pytest.mark.parametrize("kw", [
    {}, {"max_num_batched_tokens": 16}, {"max_total_tokens": 192, "max_num_seqs": 4},
], ids=["default", "chunked", "preempt"])
def test_drafters_keep_greedy_outputs(tiny_ckpt: Path, spec_plain: LLM,
                                      spec_prompts: list[list[int]], drafters: dict,
                                      drafter: str, kw: dict) -> None:
    llm = LLM(tiny_ckpt, **drafters[drafter], **kw)
    # every draft verified whatever the timings: the schedule would rightly stop a drafter
    # that costs k forwards of the target itself ("self"), or random drafts, from drafting
    llm.engine.spec.cost = StepCost(fitted=False, prior_tokens=math.inf)  # type: ignore
    refs = reference(spec_plain, spec_prompts)
    # a mixed batch: one request with a penalty never drafts (its output is compared with the
    # plain engine's under the same penalty)
    penalised = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True,
                               repetition_penalty=1.3)
    for _ in range(2):  # the second round hits the prefix cache
        outs = llm.generate(prompt_token_ids=spec_prompts + [spec_prompts[0]],
                            sampling_params=[GREEDY] * len(spec_prompts) + [penalised])
        assert [o.token_ids for o in outs[:-1]] == refs
        alone = spec_plain.generate(prompt_token_ids=[spec_prompts[0]],
                                    sampling_params=penalised)[0]
        assert outs[-1].token_ids == alone.token_ids and outs[-1].outputs[0].spec_num_drafted == 0
        llm.check_integrity()
    m = llm.get_metrics()
    assert m["spec_num_verifies"] > 0 and m["spec_num_drafted"] > 0
    if drafter == "self":  # the draft computes the target's function: every draft accepted
        assert m["spec_num_accepted"] == m["spec_num_drafted"]
    if "max_total_tokens" in kw:
        assert m["num_preemptions"] > 0
    if drafter == "self":
        c = outs[1].outputs[0]
        assert c.spec_num_verifies > 0 and c.spec_num_drafted >= c.spec_num_verifies


@pytest.mark.parametrize("corrupt", [set(), {0}, {2}], ids=["all", "none", "some"])
@pytest.mark.parametrize("drafter", ["self", "block", "dspark"])
def test_forced_acceptance_rolls_back_exactly(tiny_ckpt: Path, spec_plain: LLM,
                                              spec_prompts: list[list[int]], drafters: dict,
                                              drafter: str, corrupt: set[int]) -> None:
    """Self-draft: the draft model's own tokens, corrupted at a position; any error in its
    state rollback would make later drafts miss, so acceptance must be exactly the corrupt
    position every step. Block: the block drafter's confidence-chosen lengths, filled with the
    target's tokens and corrupted the same way."""
    k = 4
    llm = LLM(tiny_ckpt, speculative_num_draft_tokens=k, **drafters[drafter])
    prompts = spec_prompts[:4]
    refs = reference(spec_plain, prompts)
    futures = {tuple(p): r for p, r in zip(prompts, refs, strict=True)}
    spec = llm.engine.spec
    assert spec is not None
    if drafter != "self":
        assert isinstance(spec.drafter, BlockDrafter)
    scripted = ScriptedDrafter(spec.drafter, k, llm.config.vocab_size,
                               futures if drafter != "self" else None, corrupt)
    spec.drafter = scripted
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == refs
    verified = [(n, j) for n, j in scripted.log if n]
    assert verified and all(j == scripted.expected_accepts(n) for n, j in verified), verified
    m = llm.get_metrics()
    if not corrupt and drafter == "self":
        assert m["spec_mean_acceptance_length"] > 3  # k + 1 but where max_tokens cuts
    for o in outs:  # per-request acceptance adds up to the engine's
        c = o.outputs[0]
        assert c.spec_num_accepted <= c.spec_num_drafted
        assert c.spec_acceptance_length == 0 or c.spec_acceptance_length >= 1
    assert sum(o.outputs[0].spec_num_accepted for o in outs) == m["spec_num_accepted"]
    llm.check_integrity()


@pytest.mark.parametrize(("drafter", "prior_tokens"), [("block", 200), ("dspark", 32)])
def test_block_drafter_lengths_vary(tiny_ckpt: Path, spec_prompts: list[list[int]],
                                    drafters: dict, drafter: str, prior_tokens: int) -> None:
    """A fixed step cost that puts the bar inside the random drafter's range of survivals
    (the block drafter's softmax confidences run lower than DSpark's untrained sigmoids,
    ~1/2 each), so its confidences, which differ per request, decide the lengths."""
    llm = LLM(tiny_ckpt, **drafters[drafter])
    spec = llm.engine.spec
    assert spec is not None and isinstance(spec.drafter, BlockDrafter)
    spec.cost = StepCost(fitted=False, prior_tokens=prior_tokens)
    llm.generate(prompt_token_ids=spec_prompts, sampling_params=GREEDY)
    assert len(spec.lengths) >= 3, spec.lengths
    llm.check_integrity()


def test_block_drafter_computes_only_the_positions_drafted(tmp_path: Path) -> None:
    """The block drafter's positions are independent, so drafting k of them computes k (its
    LM head runs k rows a request, not block_size) and equals the whole block's first k."""
    import torch

    path = make_block_drafter(tmp_path / "block", preset_config("tiny"), block_size=4)
    drafter = BlockDrafter.load(path, preset_config("tiny"), 4, torch.float32,
                                torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, preset_config("tiny").hidden_size, generator=g)
    tokens = torch.randint(0, 100, (3,), generator=g)
    whole = drafter.net(hidden, tokens)
    cut = drafter.net(hidden, tokens, 2)
    assert whole.shape[1] == 4 and cut.shape[1] == 2
    torch.testing.assert_close(cut, whole[:, :2])
    drafts, conf = drafter.draft(hidden, tokens, 2)
    assert torch.equal(drafts, whole[:, :2].argmax(-1))


def test_drafters_reject_mismatched_checkpoints(tiny_ckpt: Path, small_ckpt: Path,
                                                tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab"):
        LLM(tiny_ckpt, speculative_algorithm="draft", speculative_draft_model=str(small_ckpt))
    other = make_block_drafter(tmp_path / "b", preset_config("small"))
    with pytest.raises(ValueError, match="vocab_size"):
        LLM(tiny_ckpt, speculative_algorithm="block", speculative_draft_model=str(other))
    with pytest.raises(ValueError, match="not a block drafter"):
        LLM(tiny_ckpt, speculative_algorithm="block", speculative_draft_model=str(tiny_ckpt))
    with pytest.raises(ValueError, match="speculative_draft_model"):
        EngineConfig(speculative_algorithm="draft")
    with pytest.raises(ValueError, match="speculative_algorithm"):
        EngineConfig(speculative_algorithm="eagle")
    # knobs of a drafter that is not in use are refused, not ignored
    with pytest.raises(ValueError, match="speculative_ngram"):
        EngineConfig(speculative_algorithm="dspark", speculative_draft_model="x",
                      speculative_ngram_max=8)
    with pytest.raises(ValueError, match="need a speculative_algorithm"):
        EngineConfig(speculative_disable_by_batch_size=4)
    with pytest.raises(ValueError, match=">= 1"):
        EngineConfig(speculative_algorithm="ngram", speculative_disable_by_batch_size=0)
    with pytest.raises(ValueError, match="speculative_ngram_min"):
        EngineConfig(speculative_algorithm="ngram", speculative_ngram_min=5)


@pytest.mark.parametrize("drafter", ["self", "block", "dspark"])
def test_sampled_requests_and_aborts(tiny_ckpt: Path, spec_prompts: list[list[int]],
                                     drafters: dict, drafter: str) -> None:
    """Sampled requests verify drafts by rejection sampling (reproducible under a seed); an
    abort mid-generation releases the draft caches too."""
    llm = LLM(tiny_ckpt, **drafters[drafter])
    # every draft verified, whatever the timings and the acceptance seen so far (verify
    # lengths decide how many random draws a step takes)
    llm.engine.spec.cost = StepCost(fitted=False, prior_tokens=math.inf)  # type: ignore
    p = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=NEW, seed=5, ignore_eos=True)
    a = llm.generate(prompt_token_ids=spec_prompts[:3], sampling_params=p)
    b = llm.generate(prompt_token_ids=spec_prompts[:3], sampling_params=p)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == NEW for o in a)
    assert llm.get_metrics()["spec_num_verifies"] > 0
    engine = llm.engine
    rid = engine.add_request(spec_prompts[3], GREEDY)
    keep = engine.add_request(spec_prompts[4], GREEDY)
    for _ in range(4):
        engine.step()
    assert engine.abort(rid)
    engine.check_integrity()
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()
    assert not engine.out.groups and keep


def test_memory_plan_counts_a_draft_models_pools_and_weights(
        tiny_ckpt: Path, small_draft: Path) -> None:
    """With a budget that bounds the KV pool, a draft model's latents (one of its blocks
    beside each of the target's), weights, state slots and extra blocks come out of it:
    everything the two models hold together within the budget, and the target's pool took
    what was left."""
    from kdaserve.engine import pools

    sized = LLM(tiny_ckpt, disable_prefix_cache=True).engine  # the pools' shapes, unbounded
    fixed = sum(t.numel() * t.element_size() for t in (
        sized.states.recurrent, sized.states.conv, *sized.model.parameters()))
    block = sized.blocks.kv.element_size() * sized.blocks.kv[:, 0].numel()
    per_block, besides = draft_memory_plan(small_draft, torch.float32, sized.blocks.block_size,
                                           DEFAULT_DRAFTS, sized.scheduler.max_num_seqs)
    # room for ~1,000 of the target's blocks with the draft's: fewer than the cap (8,192)
    fraction = (fixed + besides + 1000 * (block + per_block)) / pools.physical_memory()
    budget = int(fraction * pools.physical_memory())
    e = LLM(tiny_ckpt, mem_fraction=fraction, disable_prefix_cache=True,
            speculative_algorithm="draft", speculative_draft_model=str(small_draft)).engine
    assert e.spec is not None
    d = e.spec.drafter
    assert 900 < e.blocks.num_blocks < 1100
    assert d.blocks.num_blocks > e.blocks.num_blocks  # its own, for every target token
    alone = LLM(tiny_ckpt, mem_fraction=fraction, disable_prefix_cache=True).engine
    assert alone.blocks.num_blocks > 1.2 * e.blocks.num_blocks  # the same budget, alone
    used = sum(t.numel() * t.element_size() for t in (
        e.blocks.kv, e.states.recurrent, e.states.conv, *e.model.parameters(),
        d.blocks.kv, d.states.recurrent, d.states.conv, *d.model.parameters()))
    assert 0.9 * budget < used <= budget


@pytest.mark.parametrize("tags", [["kv_cache"], ["weights", "kv_cache"]])
def test_rl_release_frees_a_draft_models_pools_and_weights(
        tiny_ckpt: Path, spec_plain: LLM, spec_prompts: list[list[int]], small_draft: Path,
        tags: list[str]) -> None:
    """release_memory_occupation frees the draft model's KV blocks and state slots with the
    target's, and its weights with the target's; resume brings the pools back zeroed and the
    weights as they were (reloaded from its path), and speculation afterwards keeps plain
    decoding's tokens."""
    llm = LLM(tiny_ckpt, speculative_algorithm="draft", speculative_draft_model=str(small_draft))
    llm.engine.spec.cost = StepCost(fitted=False, prior_tokens=math.inf)  # type: ignore
    d = llm.engine.spec.drafter  # type: ignore[union-attr]
    weights = [p.detach().clone() for p in d.model.parameters()]
    refs = reference(spec_plain, spec_prompts[:3])
    out = llm.generate(prompt_token_ids=spec_prompts[:3], sampling_params=GREEDY)
    assert [o.token_ids for o in out] == refs
    sizes = (d.blocks.kv.numel(), d.states.recurrent.numel(), d.states.conv.numel())
    llm.engine.rl.release_memory_occupation(tags)
    assert d.blocks.kv.numel() == d.states.recurrent.numel() == d.states.conv.numel() == 0
    assert all(p.numel() == 0 for p in d.model.parameters()) == ("weights" in tags)
    llm.engine.rl.resume_memory_occupation(tags)
    assert (d.blocks.kv.numel(), d.states.recurrent.numel(), d.states.conv.numel()) == sizes
    assert not d.blocks.kv.any() and not d.states.recurrent.any()
    for p, w in zip(d.model.parameters(), weights, strict=True):
        assert torch.equal(p, w)
    verifies = llm.get_metrics()["spec_num_verifies"]
    out = llm.generate(prompt_token_ids=spec_prompts[:3], sampling_params=GREEDY)
    assert [o.token_ids for o in out] == refs
    assert llm.get_metrics()["spec_num_verifies"] > verifies
    llm.check_integrity()
