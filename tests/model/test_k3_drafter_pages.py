"""A context drafter's pages (speculative/context_pages.py): its projected context, paged in
the target's KV blocks. The batched, padded, incremental draft pass equals one request's pass
in one piece; a row reads as valid only once written since its block was handed out; a second
chat turn drafts from the first turn's cached context; the memory plan leaves room for the
pages and the drafter's weights, and RL's release and resume of the KV cache free them and
bring them back empty."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kdaserve import LLM, SamplingParams
from kdaserve.cache.block_pool import BlockPool
from kdaserve.engine import pools
from kdaserve.request import Request
from kdaserve.speculative.context_drafter import ContextDrafter, load_net
from kdaserve.speculative.context_net import FORMATS

from .conftest import K3_GREEDY, k3_drafter_engine


def paged_drafter(path: Path, k3_plain: LLM, block_size: int = 4) -> ContextDrafter:
    pool = BlockPool(k3_plain.engine.model_config, 64, block_size, torch.float32)
    return ContextDrafter.load(path, k3_plain.engine.model, torch.float32, torch.device("cpu"),
                               pool)


def holding(drafter: ContextDrafter, name: str, prompt: list[int], computed: int) -> Request:
    """A request that has computed `computed` tokens of prompt, holding blocks for them."""
    req = Request(name, prompt, SamplingParams(temperature=0.0, max_tokens=8))
    req.num_computed_tokens = computed
    pool = drafter.pages.pool
    req.block_ids = pool.allocate(pool.blocks_needed(computed))
    return req


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_batched_padded_incremental_pass_equals_one_piece(k3_ckpt: Path, k3_plain: LLM,
                                                          k3_drafters: dict[str, Path],
                                                          k3_prompts: list[list[int]],
                                                          fmt: str) -> None:
    """Two requests of different context lengths drafted together (padded keys masked), their
    contexts appended in chunks with a gap, equal each drafted alone from the same context
    written in one piece."""
    drafter = paged_drafter(k3_drafters[fmt], k3_plain)
    reqs, taps = [], []
    for n, p in enumerate(k3_prompts[1:]):
        req = holding(drafter, f"r{n}", p, len(p) - 1)
        _, t = k3_plain.prefill_taps(p[:-1], drafter.taps, drafter.context_stream)
        assert t is not None
        for a in range(0, len(p) - 1, 5):  # in chunks of 5, positions 5-9 never tapped
            if a != 5:
                drafter.on_context(req, t[a:a + 5], a)
        reqs.append(req)
        taps.append(t)
    drafter.propose(reqs)
    together = [(r.draft_ids, drafter.survival(r)) for r in reqs]
    assert all(len(d) == drafter.k for d, _ in together)
    for req, t, (drafts, survival) in zip(reqs, taps, together, strict=True):
        alone = paged_drafter(k3_drafters[fmt], k3_plain)
        one = holding(alone, "alone", req.prompt_ids, req.num_computed_tokens)
        alone.on_context(one, t, 0)  # in one piece, then positions 5-9 marked unwritten
        alone.project(list(alone.pending.values()))
        alone.pages.stamp[one.block_ids[1], 1:] = 0
        alone.pages.stamp[one.block_ids[2], :2] = 0
        alone.propose([one])
        assert one.draft_ids == drafts
        if FORMATS[fmt].dspark:
            torch.testing.assert_close(torch.tensor(alone.survival(one)),
                                       torch.tensor(survival), atol=1e-6, rtol=1e-5)
        else:
            assert alone.survival(one) is None


def test_pages_read_only_what_was_written_since_the_block_was_handed_out(
        k3_ckpt: Path, k3_plain: LLM, k3_drafters: dict[str, Path]) -> None:
    """A row reads as valid once written; a block freed and handed out again reads as empty
    until its new owner writes it; entries are read back in position order."""
    drafter = paged_drafter(k3_drafters["k3-dspark-gqa"], k3_plain, block_size=4)
    pages, pool = drafter.pages, drafter.pages.pool
    blocks = pool.allocate(3)
    width = pages.layers[0].shape[2:]
    rows = [torch.randn(6, *width) for _ in pages.layers]
    pages.write(blocks, torch.arange(3, 9), rows)
    entries, valid = pages.read(blocks, 10)
    assert valid.tolist() == [False] * 3 + [True] * 6 + [False]
    for got, written in zip(entries, rows, strict=True):
        torch.testing.assert_close(got[3:9], written)
    pool.free(blocks[1:])
    again = pool.allocate(2)
    assert sorted(again) == sorted(blocks[1:])  # the same blocks, stale rows
    _, valid = pages.read([blocks[0], *again], 10)
    assert valid.tolist() == [False] * 3 + [True] + [False] * 6
    entries, valid = pages.read(blocks, 0)
    assert valid.numel() == 0 and entries[0].shape[0] == 0


def first_proposal(llm: LLM, ids: list[int]) -> tuple[list[int], int, list[torch.Tensor],
                                                      torch.Tensor]:
    """Generates from ids; returns the tokens and, as the request's first proposal saw it,
    its cached prompt tokens and its context pages (entries, valid)."""
    spec = llm.engine.spec
    assert spec is not None and isinstance(spec.drafter, ContextDrafter)
    drafter = spec.drafter
    seen: list[tuple[int, list[torch.Tensor], torch.Tensor]] = []
    propose = drafter.propose

    def spy(reqs: list[Request]) -> None:
        propose(reqs)
        if not seen:
            r = reqs[0]
            seen.append((r.num_cached_prompt,
                         *drafter.pages.read(r.block_ids, r.num_computed_tokens)))

    drafter.propose = spy  # type: ignore[method-assign]
    try:
        out = llm.generate(prompt_token_ids=[ids], sampling_params=K3_GREEDY)[0].token_ids
    finally:
        del drafter.propose
    return out, *seen[0]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_second_turn_drafts_from_the_cached_turns_context(
        k3_ckpt: Path, k3_drafters: dict[str, Path], k3_plain: LLM, k3_prompts: list[list[int]],
        k3_want: list[list[int]], fmt: str) -> None:
    """A second chat turn resumes from the first turn's cached blocks: the drafter's context
    there is the first turn's (paged in the same blocks), so at its first proposal every
    position is in the context, equal to the entries of one plain forward's taps; a turn
    whose first turn never drafted finds those positions empty; tokens stay plain's."""
    turn2 = k3_prompts[2] + k3_want[2] + k3_prompts[0]
    second = k3_plain.generate(prompt_token_ids=[turn2], sampling_params=K3_GREEDY)[0].token_ids
    net = load_net(k3_drafters[fmt], k3_plain.engine.model_config, torch.float32,
                   torch.device("cpu"))
    _, taps = k3_plain.prefill_taps(turn2, net.c.taps, FORMATS[fmt].tap_stream)
    assert taps is not None
    llm = k3_drafter_engine(k3_ckpt, k3_drafters[fmt], fmt, block_size=4, snapshot_interval=8)
    llm.generate(prompt_token_ids=[k3_prompts[2]], sampling_params=K3_GREEDY)
    got, hit, entries, valid = first_proposal(llm, turn2)
    assert got == second and hit >= 32  # most of the first turn
    assert valid.all()  # the first turn's positions, and the second's own
    n = valid.shape[0]
    with torch.inference_mode():
        expect = net.context(taps[:n], torch.arange(n))
    for e, x in zip(entries, expect, strict=True):
        torch.testing.assert_close(e, x, atol=1e-3, rtol=1e-3)
    llm.check_integrity()
    # the first turn drafted nothing (one token): its positions are not in the context
    llm = k3_drafter_engine(k3_ckpt, k3_drafters[fmt], fmt, block_size=4, snapshot_interval=8)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[k3_prompts[2]], sampling_params=one)[0].token_ids
    _, hit, _, valid = first_proposal(llm, k3_prompts[2] + out + k3_prompts[0])
    assert hit >= 32 and not valid[:hit].any() and valid[hit:].all()
    llm.check_integrity()


def test_memory_plan_counts_the_pages_and_the_drafters_weights(
        k3_ckpt: Path, k3_drafters: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """With a budget that bounds the KV pool, a published drafter's pages (per KV block) and
    weights come out of it: fewer blocks than the target alone gets, and blocks, pages,
    states, the target's and the drafter's weights together within the budget; the
    pages' size is what the plan counted for them."""
    sized = LLM(k3_ckpt, disable_prefix_cache=True).engine  # the pools' shapes, unbounded
    fixed = sum(t.numel() * t.element_size() for t in (
        sized.states.recurrent, sized.states.conv, *sized.model.parameters()))
    block = sized.blocks.kv.element_size() * sized.blocks.kv[:, 0].numel()
    # room for ~1,000 of the target's blocks: fewer than its default cap (8,192)
    fraction = (fixed + 1000 * block) / pools.physical_memory()
    budget = int(fraction * pools.physical_memory())
    alone = LLM(k3_ckpt, mem_fraction=fraction, disable_prefix_cache=True)
    assert 900 < alone.engine.blocks.num_blocks < 1100
    fmt = "k3-dspark-mla"
    llm = k3_drafter_engine(k3_ckpt, k3_drafters[fmt], fmt, mem_fraction=fraction,
                            disable_prefix_cache=True)
    e = llm.engine
    assert e.blocks.num_blocks < alone.engine.blocks.num_blocks  # the budget bounds both
    spec = e.spec
    assert spec is not None and isinstance(spec.drafter, ContextDrafter)
    pages, net = spec.drafter.pages, spec.drafter.net
    per_block = pages.bytes_per_block(net.c.cache_width, net.c.num_layers, torch.float32,
                                      e.blocks.block_size)
    assert pages.nbytes == per_block * e.blocks.num_blocks
    used = sum(t.numel() * t.element_size() for t in (
        e.blocks.kv, e.states.recurrent, e.states.conv, *e.model.parameters(),
        *net.parameters())) + pages.nbytes
    assert used <= budget
    assert used > 0.9 * budget  # the KV pool took what was left


@pytest.mark.parametrize("tags", [["kv_cache"], ["weights", "kv_cache"]])
def test_rl_release_frees_the_pages_and_resume_brings_them_back_empty(
        k3_ckpt: Path, k3_drafters: dict[str, Path], k3_want: list[list[int]],
        k3_prompts: list[list[int]], tags: list[str]) -> None:
    """release_memory_occupation frees the drafter's pages with the KV blocks and its own
    weights with the target's; resume brings the pages back zeroed (every row unwritten) and
    the weights as they were (reloaded from the drafter's path), and speculation afterwards
    keeps plain decoding's tokens."""
    fmt = "k3-dspark-gqa"
    llm = k3_drafter_engine(k3_ckpt, k3_drafters[fmt], fmt)
    spec = llm.engine.spec
    assert spec is not None and isinstance(spec.drafter, ContextDrafter)
    pages, net = spec.drafter.pages, spec.drafter.net
    weights = [p.detach().clone() for p in net.parameters()]
    out = llm.generate(prompt_token_ids=k3_prompts, sampling_params=K3_GREEDY)
    assert [o.token_ids for o in out] == k3_want
    size = pages.nbytes
    assert bool(pages.stamp.any())  # rows were written
    llm.engine.rl.release_memory_occupation(tags)
    assert pages.nbytes == 0
    assert all(p.numel() == 0 for p in net.parameters()) == ("weights" in tags)
    llm.engine.rl.resume_memory_occupation(tags)
    assert pages.nbytes == size and not bool(pages.stamp.any())
    for p, w in zip(net.parameters(), weights, strict=True):
        assert torch.equal(p, w)
    verifies = llm.get_metrics()["spec_num_verifies"]
    out = llm.generate(prompt_token_ids=k3_prompts, sampling_params=K3_GREEDY)
    assert [o.token_ids for o in out] == k3_want
    assert llm.get_metrics()["spec_num_verifies"] > verifies
    llm.check_integrity()
