"""Prompt log-probabilities, logit_bias and min_tokens in the engine: prompt logprobs equal a
plain full-sequence forward's log-softmax and transformers' (fp32, 1e-4) through chunked
prefill, prefix-cache hits, batching, n > 1 and preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kdaserve import LLM, SamplingParams

from .conftest import clear_prompt

LENGTHS = [1, 2, 7, 40, 90, 130]


@pytest.fixture(scope="module")
def llm(tiny_ckpt: Path) -> LLM:
    return LLM(tiny_ckpt, max_num_batched_tokens=48, block_size=8, snapshot_interval=16)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    return [clear_prompt(llm, n, seed=77 + n, continuation=4) for n in LENGTHS]


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 2, "ignore_eos": True, **kw})


def check(lps: list, prompt: list[int], ref: torch.Tensor, start: int, top: int) -> None:
    """ref: [T, vocab] log-softmax of a plain forward over the prompt."""
    assert len(lps) == len(prompt) - start
    for i, entry in enumerate(lps):
        pos = start + i
        if pos == 0:
            assert entry is None
            continue
        row = ref[pos - 1]
        assert prompt[pos] in entry
        best = row.topk(top).indices.tolist() if top else []
        assert set(entry) == {prompt[pos], *best}
        for t, v in entry.items():
            assert abs(v - row[t].item()) < 1e-4


def test_prompt_logprobs_match_plain_forward_and_transformers(llm: LLM, prompts,
                                                              hf_tiny) -> None:
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params(prompt_logprobs=3))
    for p, out in zip(prompts, outs, strict=True):
        ref = llm.prefill_logits(p).log_softmax(-1)
        check(out.prompt_logprobs, p, ref, 0, 3)
        with torch.no_grad():
            hf = hf_tiny(torch.tensor([p])).logits[0].float().log_softmax(-1)
        for pos in range(1, len(p)):
            assert abs(out.prompt_logprobs[pos][p[pos]] - hf[pos - 1, p[pos]].item()) < 1e-4
    llm.check_integrity()


def test_prefix_hits_and_start_len(llm: LLM, prompts) -> None:
    p = prompts[-1]
    llm.generate(prompt_token_ids=[p], sampling_params=params())  # cache the whole prompt
    ref = llm.prefill_logits(p).log_softmax(-1)
    for start in (0, 1, 50, len(p) - 1, len(p)):
        before = llm.get_metrics()["prefix_cache_hit_tokens"]
        out = llm.generate(prompt_token_ids=[p], sampling_params=params(
            prompt_logprobs=0, logprob_start_len=start))[0]
        check(out.prompt_logprobs, p, ref, start, 0)
        hit = llm.get_metrics()["prefix_cache_hit_tokens"] - before
        assert hit == out.num_cached_tokens <= max(start - 1, 0)
        if start >= 50:  # the cache still serves what precedes the scored part
            assert out.num_cached_tokens > 0
    with pytest.raises(ValueError, match="logprob_start_len"):
        llm.generate(prompt_token_ids=[p], sampling_params=params(
            prompt_logprobs=0, logprob_start_len=len(p) + 1))
    llm.check_integrity()


def test_n_siblings_and_preemption(tiny_ckpt: Path, prompts) -> None:
    # (no stride snapshots: with them the siblings share enough of their prompts that this
    # pool no longer runs short, and preemption is what is tested here)
    small = LLM(tiny_ckpt, block_size=4, max_total_tokens=2 * 140, max_num_batched_tokens=32,
                prefill_snapshot_stride=0)
    sp = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=8, ignore_eos=True,
                        prompt_logprobs=1, token_ids_logprob=[5, 9])
    outs = small.generate(prompt_token_ids=prompts, sampling_params=sp)
    assert small.get_metrics()["num_preemptions"] > 0
    for p, out in zip(prompts, outs, strict=True):
        ref = small.prefill_logits(p).log_softmax(-1)
        lps = out.prompt_logprobs
        assert len(lps) == len(p)
        for pos in range(1, len(p)):
            for t in (p[pos], 5, 9, int(ref[pos - 1].argmax())):
                assert abs(lps[pos][t] - ref[pos - 1, t].item()) < 1e-4
    small.check_integrity()


def test_logit_bias_and_min_tokens(llm: LLM, prompts) -> None:
    p = prompts[3]
    plain = llm.generate(prompt_token_ids=[p], sampling_params=params(max_tokens=6))[0]
    forced = llm.generate(prompt_token_ids=[p], sampling_params=params(
        max_tokens=6, logit_bias={1000: 100.0}, logprobs=0))[0]
    assert forced.token_ids == [1000] * 6 != plain.token_ids
    # logprobs stay those of the model's raw distribution
    ref = llm.prefill_logits(p + [1000]).log_softmax(-1)
    assert abs(forced.outputs[0].logprobs[0][1000] - ref[len(p) - 1, 1000].item()) < 1e-4
    banned = llm.generate(prompt_token_ids=[p], sampling_params=params(
        max_tokens=6, logit_bias={plain.token_ids[0]: -100.0}))[0]
    assert banned.token_ids[0] != plain.token_ids[0]
    # an EOS made irresistible is still refused before min_tokens
    eos = llm.config.eos_token_ids[0]
    sp = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=3, logit_bias={eos: 100.0})
    out = llm.generate(prompt_token_ids=[p], sampling_params=sp)[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == eos and out.finish_reason == "stop"
    for bad in ({10**9: 1.0}, {1: 101.0}):
        with pytest.raises(ValueError, match="logit_bias"):
            llm.generate(prompt_token_ids=[p], sampling_params=params(logit_bias=bad))
    llm.check_integrity()


def test_logit_bias_holds_under_speculation(tiny_ckpt: Path) -> None:
    """Speculative verification samples raw rows, so biased requests decode without drafts."""
    spec = LLM(tiny_ckpt, speculative_algorithm="ngram", speculative_num_draft_tokens=4)
    p = list(range(5, 15)) * 8  # repetitive: the n-gram drafter proposes plenty
    out = spec.generate(prompt_token_ids=[p], sampling_params=SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, logit_bias={77: 100}))[0]
    assert out.token_ids == [77] * 12  # an int bias works too
    spec.check_integrity()
