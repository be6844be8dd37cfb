"""Speculative decoding (n-gram drafts, greedy verification, KDA state rollback): outputs
identical to plain decoding whether 0, some or all drafts are accepted, in mixed batches, with
chunked prefill and prefix-cache hits; every pool consistent afterwards."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kdaserve import LLM, SamplingParams
from kdaserve.speculative import explore
from kdaserve.speculative.drafter import TokenDrafter
from kdaserve.speculative.ngram import NgramDrafter
from kdaserve.speculative.schedule import StepCost
from kdaserve.speculative.scripted import ScriptedDrafter

from .conftest import SPEC_NEW as NEW
from .conftest import greedy_outputs as reference

GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def test_ngram_drafter_proposes_what_followed_the_last_occurrence() -> None:
    d = NgramDrafter(3, max_n=3)
    assert d.propose_ids([1, 2, 3, 4, 5, 9, 2, 3]) == [4, 5, 9]  # "2 3" seen before, then 4 5 9
    assert d.propose_ids([7, 8, 9]) == []  # nothing recurs
    assert d.propose_ids([5, 6, 5, 6], k=1) == [5]
    assert d.propose_ids([1, 2, 1]) == [2, 1]  # runs up to the end of the history
    with pytest.raises(ValueError):
        NgramDrafter(0)


@pytest.mark.parametrize("kw", [
    {}, {"max_num_batched_tokens": 16}, {"disable_prefix_cache": True},
    {"speculative_num_draft_tokens": 1}, {"block_size": 1},
], ids=["default", "chunked", "no_cache", "k1", "block1"])
def test_ngram_speculation_keeps_greedy_outputs(tiny_ckpt: Path, spec_plain: LLM,
                                                spec_prompts: list[list[int]], kw: dict) -> None:
    llm = LLM(tiny_ckpt, speculative_algorithm="ngram", **kw)
    outs = llm.generate(prompt_token_ids=spec_prompts, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == reference(spec_plain, spec_prompts)
    m = llm.get_metrics()
    # the looped prompt recurs, so drafts are verified (random weights rarely accept them;
    # acceptance itself is forced in test_forced_acceptance_patterns)
    assert m["spec_num_verifies"] > 0 and m["spec_num_drafted"] > 0
    llm.check_integrity()
    # a second round hits the prefix cache and still matches
    outs = llm.generate(prompt_token_ids=spec_prompts, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == reference(spec_plain, spec_prompts)
    llm.check_integrity()


@pytest.mark.parametrize("corrupt,accepts", [(set(), "all"), ({0}, "none"), ({2}, "some")])
def test_forced_acceptance_patterns(tiny_ckpt: Path, spec_plain: LLM, spec_prompts: list[list[int]],
                                    corrupt: set[int], accepts: str) -> None:
    k = 4
    llm = LLM(tiny_ckpt, speculative_algorithm="ngram", speculative_num_draft_tokens=k)
    refs = reference(spec_plain, spec_prompts[:4])
    futures = {tuple(p): r for p, r in zip(spec_prompts[:4], refs, strict=True)}
    llm.engine.spec.drafter = ScriptedDrafter(None, k, llm.config.vocab_size, futures, corrupt)
    sampled = SamplingParams(temperature=1.0, max_tokens=NEW, seed=3, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=spec_prompts[:4] + [spec_prompts[4]],
                        sampling_params=[GREEDY] * 4 + [sampled])  # a mixed batch
    assert [o.token_ids for o in outs[:4]] == refs
    alone = spec_plain.generate(prompt_token_ids=[spec_prompts[4]], sampling_params=sampled)[0]
    assert outs[4].token_ids == alone.token_ids  # the sampled request is unaffected
    m = llm.get_metrics()
    rate = m["spec_num_accepted"] / m["spec_num_drafted"]
    if accepts == "all":
        assert rate == 1.0 and m["spec_mean_acceptance_length"] > 3
    elif accepts == "none":
        assert m["spec_num_accepted"] == 0
    else:
        assert 0 < rate < 1
    llm.check_integrity()


def test_speculation_respects_max_tokens_and_stops(tiny_ckpt: Path, spec_plain: LLM,
                                                   spec_prompts: list[list[int]]) -> None:
    llm = LLM(tiny_ckpt, speculative_algorithm="ngram")
    ref = reference(spec_plain, [spec_prompts[-1]])[0]
    stop_at = ref[7]
    params = SamplingParams(temperature=0.0, max_tokens=NEW, stop_token_ids=[stop_at])
    out = llm.generate(prompt_token_ids=[spec_prompts[-1]], sampling_params=params)[0]
    assert out.token_ids == ref[: ref.index(stop_at) + 1] and out.finish_reason == "stop"
    short = llm.generate(prompt_token_ids=[spec_prompts[-1]], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    assert short.token_ids == ref[:5]
    llm.check_integrity()


def test_rejection_sampling_preserves_the_target_distribution() -> None:
    """Point-mass drafts (as the n-gram drafter proposes): the first emitted token must be
    distributed as p_0 whatever is drafted, and the second, given the first accepted draft,
    as p_1 (a chi-square-free check: max |freq - p| over a 5-token vocabulary, fixed seed)."""
    from kdaserve.speculative.acceptance import reject_sample

    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05],
                          [0.1, 0.6, 0.1, 0.1, 0.1],
                          [0.2, 0.2, 0.2, 0.2, 0.2]])
    trials = 20000
    for drafts in ([0, 1], [3, 4], [4, 0]):
        first = torch.zeros(5)
        second = torch.zeros(5)
        for _ in range(trials):
            j, nxt = reject_sample(probs, drafts, g)
            tokens = drafts[:j] + [nxt]
            first[tokens[0]] += 1
            if tokens[0] == drafts[0] and len(tokens) > 1:
                second[tokens[1]] += 1
        assert (first / trials - probs[0]).abs().max() < 0.015, (drafts, first / trials)
        assert (second / second.sum() - probs[1]).abs().max() < 0.03, (drafts, second)


def test_sampled_requests_with_drafts_are_reproducible(tiny_ckpt: Path,
                                                       spec_prompts: list[list[int]]) -> None:
    llm = LLM(tiny_ckpt, speculative_algorithm="ngram")

    class Fixed(TokenDrafter):  # always three tokens: every step verifies by rejection sampling
        k = 3

        def propose_ids(self, ids: list[int], k: int | None = None) -> list[int]:
            return ids[-7:-4][: self.k if k is None else k]

    llm.engine.spec.drafter = Fixed()
    # every draft verified: with the fitted schedule the verify lengths, hence how many
    # random draws a step takes, would follow timings and the acceptance seen so far
    llm.engine.spec.cost = StepCost(fitted=False, prior_tokens=math.inf)
    p = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=NEW, seed=11, ignore_eos=True)
    a = llm.generate(prompt_token_ids=[spec_prompts[-1]], sampling_params=p)[0].token_ids
    b = llm.generate(prompt_token_ids=[spec_prompts[-1]], sampling_params=p)[0].token_ids
    assert a == b and len(a) == NEW
    assert llm.get_metrics()["spec_num_verifies"] > 0
    llm.check_integrity()


def test_partial_acceptance_leaves_the_states_of_plain_decoding(
        tiny_ckpt: Path, spec_prompts: list[list[int]]) -> None:
    """After verifies that keep 2 of 4 drafts (0 of 4 for one request, so the replayed spans
    differ within a batch), each request's KDA recurrent and conv states in the pool equal a
    plain engine's after decoding the same tokens: the rollback replays exactly the accepted
    steps."""
    k, prompts = 4, spec_prompts[:3]
    plain = LLM(tiny_ckpt, disable_prefix_cache=True)
    refs = reference(plain, prompts)
    futures = {tuple(p): r for p, r in zip(prompts, refs, strict=True)}
    llm = LLM(tiny_ckpt, speculative_algorithm="ngram", speculative_num_draft_tokens=k,
              disable_prefix_cache=True)
    vocab = llm.config.vocab_size

    class Scripted(ScriptedDrafter):
        def propose(self, reqs: list) -> None:
            super().propose(reqs)
            for req in reqs:
                if req.prompt_ids == prompts[1] and req.draft_ids:
                    req.draft_ids[0] = (req.draft_ids[0] + 1) % vocab

    engine = llm.engine
    assert engine.spec is not None
    engine.spec.drafter = scripted = Scripted(None, k, vocab, futures, {2})
    for p in prompts:
        engine.add_request(p, GREEDY)
    while len(scripted.log) < 2 * len(prompts):  # every request verified twice
        engine.step()
    assert {j for n, j in scripted.log if n} == {0, 2}
    states = engine.states
    for req, prompt in zip(engine.scheduler.running, prompts, strict=True):
        assert req.prompt_ids == prompt and req.num_computed_tokens == req.num_tokens - 1
        rid = plain.engine.add_request(prompt, GREEDY)
        mine = plain.engine.out.groups[rid][0]
        while len(mine.output_ids) < len(req.output_ids):
            plain.engine.step()
        assert mine.output_ids == req.output_ids
        for pool in ("recurrent", "conv"):
            ours = getattr(states, pool)[:, req.state_slot]
            theirs = getattr(plain.engine.states, pool)[:, mine.state_slot]
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5, msg=pool)
        plain.engine.abort(rid)
    plain.engine.check_integrity()


def test_adaptive_speculation_in_the_engine(tiny_ckpt: Path, spec_plain: LLM,
                                            spec_prompts: list[list[int]]) -> None:
    """Requests whose drafts never land stop drafting after a few verifies (and outputs stay
    those of plain decoding); a batch larger than the limit drafts nothing, and a batch
    that shrinks back under it drafts again."""
    k, prompts = 4, spec_prompts[:4]
    refs = reference(spec_plain, prompts)
    futures = {tuple(p): r for p, r in zip(prompts, refs, strict=True)}
    llm = LLM(tiny_ckpt, speculative_algorithm="ngram", speculative_num_draft_tokens=k,
              speculative_min_acceptance_rate=0.3)
    scripted = ScriptedDrafter(None, k, llm.config.vocab_size, futures, corrupt={0})
    llm.engine.spec.drafter = scripted  # type: ignore[union-attr]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == refs
    m = llm.get_metrics()
    assert m["spec_num_switched_off"] >= len(prompts)
    # each request verified its first few steps, then decoded plainly (NEW - 1 would be
    # one verify per token)
    assert 4 * len(prompts) <= m["spec_num_verifies"] < len(prompts) * (NEW - 1) / 2
    llm.check_integrity()

    limited = LLM(tiny_ckpt, speculative_algorithm="ngram", speculative_num_draft_tokens=k,
                  speculative_disable_by_batch_size=2)
    limited.engine.spec.drafter = ScriptedDrafter(  # type: ignore[union-attr]
        None, k, llm.config.vocab_size, futures)
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = limited.generate(prompt_token_ids=prompts, sampling_params=[short] * 3 + [GREEDY])
    assert outs[3].token_ids == refs[3] and [o.token_ids for o in outs[:3]] == [
        r[:4] for r in refs[:3]]
    m = limited.get_metrics()
    assert m["spec_num_batch_skips"] > 0
    assert outs[0].outputs[0].spec_num_verifies == 0  # it only ran in the large batch
    assert outs[3].outputs[0].spec_num_verifies > 0  # alone, it drafted again
    limited.check_integrity()


def test_verify_schedule_backs_off_under_load(tiny_ckpt: Path, spec_plain: LLM,
                                              spec_prompts: list[list[int]]) -> None:
    """With a step cost where one token costs half a step's fixed part (b/a = 1/2) and
    drafts each kept at a stated chance of 0.6 (survival 0.6, 0.36, ...): eight decoding
    requests find no draft worth its cost (the bar is b E / (a + b T) = 0.8) and soon stop
    drafting at all, while one request alone verifies exactly one draft a step (bars 0.33,
    then 0.4 > 0.36); outputs equal plain decoding. The engine feeds its decode steps'
    timings to the fitted model."""
    k, prompts = 4, spec_prompts[:8]
    refs = reference(spec_plain, prompts)
    futures = {tuple(p): r for p, r in zip(prompts, refs, strict=True)}
    llm = LLM(tiny_ckpt, speculative_algorithm="ngram", speculative_num_draft_tokens=k)
    spec = llm.engine.spec
    assert spec is not None
    spec.drafter = ScriptedDrafter(None, k, llm.config.vocab_size, futures)
    spec.drafter.survival = lambda req: [  # type: ignore[method-assign]
        0.6 ** (i + 1) for i in range(len(req.draft_ids))]
    spec.cost = StepCost(fitted=False, prior_tokens=2)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == refs
    m = llm.get_metrics()
    assert m["spec_num_verifies"] == 0 and m["spec_num_schedule_skips"] > NEW // 2
    alone = llm.generate(prompt_token_ids=prompts[:1], sampling_params=GREEDY)[0]
    assert alone.token_ids == refs[0]
    assert alone.outputs[0].spec_num_verifies > 0 and max(spec.lengths) == 1
    llm.check_integrity()

    timed = LLM(tiny_ckpt, speculative_algorithm="ngram", speculative_num_draft_tokens=k)
    timed.generate(prompt_token_ids=prompts[:2], sampling_params=GREEDY)
    assert timed.engine.spec is not None and timed.engine.spec.cost.num_observed > 0


def test_a_stale_fit_is_explored(tiny_ckpt: Path, spec_plain: LLM,
                                 spec_prompts: list[list[int]],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A fit that says a token costs 5 fixed parts (what a few slow first verifies can make
    of it: alone, a draft's bar is 5 / 6 = 0.83) stops all drafting: the first try (both
    requests) verifies none. After EXPLORE_AFTER skipped steps in a row (the budget set free
    here) EXPLORE_STEPS steps draft at the prior (two of the 0.6-a-draft drafts verified
    beside two decodes), each for one request of the two, in turn. With the budget at 0 no
    exploration follows the first try. The drafting pass is timed apart. Outputs equal
    plain decoding."""
    monkeypatch.setattr(explore, "EXPLORE_AFTER", 3)
    k, prompts = 4, spec_prompts[:2]
    refs = reference(spec_plain, prompts)

    def run(share: float) -> tuple[LLM, list[list[int]]]:
        monkeypatch.setattr(explore, "EXPLORE_SHARE", share)
        llm = LLM(tiny_ckpt, speculative_algorithm="ngram", speculative_num_draft_tokens=k)
        spec = llm.engine.spec
        assert spec is not None
        spec.drafter = ScriptedDrafter(None, k, llm.config.vocab_size,
                                       {tuple(p): r for p, r in zip(prompts, refs,
                                                                    strict=True)})
        spec.drafter.survival = lambda req: [  # type: ignore[method-assign]
            0.6 ** (i + 1) for i in range(len(req.draft_ids))]
        for t in (1, 3) * 50:  # t = 2 ms + 10 ms a token
            spec.cost.observe(t, 2e-3 + 1e-2 * t)
        assert spec.cost.slope_ratio() == pytest.approx(5)
        # the engine's timed steps are kept out of the fit, so it stays stale
        spec.cost.observe = lambda tokens, seconds: None  # type: ignore[method-assign]
        calls: list[int] = []
        propose = spec.drafter.propose
        spec.drafter.propose = lambda reqs: (calls.append(len(reqs)),  # type: ignore
                                             propose(reqs))[1]
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        assert [o.token_ids for o in outs] == refs
        llm.check_integrity()
        return llm, [calls]

    llm, (calls,) = run(1e9)
    spec = llm.engine.spec
    assert spec is not None
    m = llm.get_metrics()
    assert m["spec_num_explorations"] >= 1 + explore.EXPLORE_STEPS  # the first try, a burst
    assert m["spec_num_schedule_skips"] >= 3
    assert m["spec_num_verifies"] >= m["spec_num_explorations"] - 1  # all but the first try
    assert calls[0] == 2 and calls[1:] == [1] * (len(calls) - 1)  # then one at a time
    assert 2 in spec.lengths and spec.draft_seconds > 0 and spec.explorer.cost > 0
    llm, (calls,) = run(0.0)  # a budget of nothing: the first try, then none
    assert llm.get_metrics()["spec_num_explorations"] == 1 and calls == [2]


def test_replay_of_a_fused_verify_is_exact() -> None:
    """A verify's KDA layers run the fused step; replaying its recorded steps from the saved
    states reproduces the states the verify left, bit for bit, whether all of a request's
    steps are replayed or a prefix followed by the rest (a rollback keeps the prefix)."""
    from kdaserve.checkpoint import preset_config
    from kdaserve.forward_batch import ForwardBatch
    from kdaserve.kernels import resolve_kernels
    from kdaserve.layers.kda import KDAttention
    from kdaserve.step_record import StepRecord

    config = preset_config("tiny")
    layer = KDAttention(config, resolve_kernels(torch.device("cpu")))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    H, K = layer.num_heads, layer.head_dim
    lengths, slots = [5, 3], [2, 0]
    rec0 = torch.randn(4, H, K, K, generator=g)
    conv0 = torch.randn(4, config.kda_conv_size - 1, 3 * H * K, generator=g)
    fb = ForwardBatch.build([[1] * n for n in lengths], [7, 7], slots, [[0], [1]], 16)
    fb.record = StepRecord(list(range(sum(lengths))), {}, "cpu")
    x = torch.randn(sum(lengths), config.hidden_size, generator=g)
    rec, conv = rec0.clone(), conv0.clone()
    with torch.no_grad():
        layer(x, fb, rec, conv)
    steps = fb.record.layers[0]
    for split in ([5, 3], [2, 1]):  # all steps at once; a prefix, then the rest
        r, c = rec0.clone(), conv0.clone()
        done = [0, 0]
        for take in (split, [n - s for n, s in zip(lengths, split, strict=True)]):
            rows = [row for b, start in enumerate((0, lengths[0]))
                    for row in range(start + done[b], start + done[b] + take[b])]
            keep = [b for b in range(2) if take[b]]
            if not keep:
                continue
            cu = torch.tensor([0, *torch.tensor([take[b] for b in keep]).cumsum(0).tolist()])
            sel = torch.tensor(rows)
            layer.replay_steps(type(steps)(*(t.index_select(0, sel) for t in steps)), cu,
                               torch.tensor([slots[b] for b in keep]), r, c)
            done = [d + t for d, t in zip(done, take, strict=True)]
        assert torch.equal(r, rec) and torch.equal(c, conv), split
